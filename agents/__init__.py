"""Agent programs: KV pinned across tool calls, program-level scheduling. Filled in by the agents issue."""

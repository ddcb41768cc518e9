"""kvgate-server.json: one kvgate server with its engine (`kvgate serve`), or several alike picked by job and
instance: traffic, latency, the engine's stages (queue, prefill, time per output token), tokens, KV reuse, the
document KV tiers, the semantic cache, the quality gate, the engine's queue, memory and agent programs."""

from __future__ import annotations

from typing import Any

from grafana import dashboard, heatmap, panel, quantiles, rate, share, state, variable

AT = 'job=~"$job", instance=~"$instance"'
GENERATING = f'{AT}, route=~"/v1/(chat/completions|completions|responses|messages)"'
TOKENS = "suffix: tok/s"
DURATION_COUNT = "kvgate_request_duration_seconds_count"


def traffic() -> list[dict[str, Any]]:
    requests = "kvgate_requests_total"
    return [
        panel("Requests", "HTTP requests per second by route.", "reqps", [(rate(requests, AT, "route"), "{{route}}")]),
        panel(
            "Errors",
            "Answers with a 4xx or 5xx status per second, by status and route.",
            "reqps",
            [(rate(requests, f'{AT}, status=~"[45].."', "status, route"), "{{status}} {{route}}")],
        ),
        panel(
            "Refused: rate limits and queues",
            "429: a key's or address's rate limit (rpm, tpm) or a tenant's share of the queue "
            "(max_waiting_seqs_per_tenant); 503: the server's queue (max_waiting_seqs) or Redis out of reach.",
            "reqps",
            [(rate(requests, f'{AT}, status=~"429|503"', "status, route"), "{{status}} {{route}}")],
        ),
        panel(
            "Refused by reason",
            "Requests refused per second, by reason: rate_limit (a key's rpm or tpm), tenant_queue_full, "
            "server_queue_full, too_many_sequences, overloaded (the embedder), redis_down, request_too_large, "
            "engine_down, upstreams_down; other: a 429 or 503 of another kind (an upstream's).",
            "reqps",
            [(rate("kvgate_refused_total", AT, "reason"), "{{reason}}")],
        ),
        panel(
            "Answered",
            "Share of requests answered with a 2xx status.",
            "percentunit",
            [(share(rate(requests, f'{AT}, status=~"2.."'), rate(requests, AT)), "2xx")],
        ),
    ]


def latency() -> list[dict[str, Any]]:
    duration, first = "kvgate_request_duration_seconds", "kvgate_time_to_first_token_seconds"
    return [
        panel(
            "End-to-end latency",
            "Request to last byte on the generating routes (chat, completions, responses, messages).",
            "s",
            quantiles(duration, GENERATING),
        ),
        panel("Time to first token", "Streamed responses: request to the first event.", "s", quantiles(first, AT)),
        panel(
            "Mean latency by route",
            "Mean request duration per route.",
            "s",
            [(share(rate(duration + "_sum", AT, "route"), rate(duration + "_count", AT, "route")), "{{route}}")],
        ),
        heatmap("Latency distribution", "End-to-end latency of the generating routes.", duration, GENERATING),
    ]


def stages() -> list[dict[str, Any]]:
    return [
        panel(
            "Queue wait",
            "Engine: a generated answer's wait from its arrival to its admission (max_num_seqs running).",
            "s",
            quantiles("kvgate_request_queue_time_seconds", AT),
        ),
        panel(
            "Prefill time",
            "Engine: admission to the first token (its KV read, any blend, the prefill of the rest).",
            "s",
            quantiles("kvgate_request_prefill_time_seconds", AT),
        ),
        panel(
            "Time per output token",
            "Answers of 2 tokens or more, whole or streamed: (last token - first token) / (tokens - 1).",
            "s",
            quantiles("kvgate_time_per_output_token_seconds", AT),
        ),
    ]


def tokens() -> list[dict[str, Any]]:
    return [
        panel(
            "Tokens",
            "Prompt and completion tokens per second, by model.",
            TOKENS,
            [
                (rate("kvgate_prompt_tokens_total", AT, "model"), "prompt {{model}}"),
                (rate("kvgate_completion_tokens_total", AT, "model"), "completion {{model}}"),
            ],
            width=12,
        ),
        panel(
            "Tokens per request",
            "Mean prompt and completion tokens of a generating request.",
            "short",
            [
                (share(rate("kvgate_prompt_tokens_total", AT), rate(DURATION_COUNT, GENERATING)), "prompt"),
                (share(rate("kvgate_completion_tokens_total", AT), rate(DURATION_COUNT, GENERATING)), "completion"),
            ],
            width=12,
        ),
    ]


def reuse() -> list[dict[str, Any]]:
    reused = "kvgate_reused_prompt_tokens_total"
    return [
        panel(
            "Reused prompt tokens by mode",
            "Prompt tokens whose KV was reused instead of computed, by how: prefix (exact prefix blocks), "
            "blend (documents at any position), naive, kvcomm, program (an agent's pinned context).",
            TOKENS,
            [(rate(reused, AT, "mode"), "{{mode}}")],
        ),
        panel(
            "Prompt tokens reused",
            "Share of prompt tokens whose KV was reused.",
            "percentunit",
            [(share(rate(reused, AT), rate("kvgate_prompt_tokens_total", AT)), "reused")],
        ),
        panel(
            "Recomputed after reuse",
            "Reused prompt tokens computed again per second: blend recomputes a share of each document's tokens "
            "(the quality gate's ratio).",
            TOKENS,
            [(rate("kvgate_recomputed_prompt_tokens_total", AT), "recomputed")],
        ),
        panel(
            "Recompute ratio per request",
            "Per request that reused KV: recomputed / reused tokens.",
            "percentunit",
            quantiles("kvgate_recompute_ratio", AT, (0.5, 0.9)),
        ),
    ]


def tiers() -> list[dict[str, Any]]:
    hits, misses = "kvgate_document_kv_hits_total", "kvgate_document_kv_misses_total"
    return [
        panel(
            "Document KV hit ratio by tier",
            "Of the lookups that reached a tier (memory, disk, redis, lmcache), the share that found the KV.",
            "percentunit",
            [(share(rate(hits, AT, "tier"), f"{rate(hits, AT, 'tier')} + {rate(misses, AT, 'tier')}"), "{{tier}}")],
        ),
        panel(
            "Document KV lookups by tier",
            "Hits and misses per second in each tier.",
            "ops",
            [(rate(hits, AT, "tier"), "hit {{tier}}"), (rate(misses, AT, "tier"), "miss {{tier}}")],
        ),
        panel(
            "Document KV bytes by tier",
            "Bytes each tier holds, and its budget (caches.*_bytes).",
            "bytes",
            [
                ("sum by (tier) (kvgate_document_kv_bytes{" + AT + "})", "held {{tier}}"),
                ("sum by (tier) (kvgate_document_kv_budget_bytes{" + AT + "})", "budget {{tier}}"),
            ],
        ),
        panel(
            "Entries by tier",
            "Entries each tier holds; pinned: kept for an agent program's next turn.",
            "short",
            [
                ("sum by (tier) (kvgate_document_kv_entries{" + AT + "})", "{{tier}}"),
                ("sum by (tier) (kvgate_pinned_entries{" + AT + "})", "pinned {{tier}}"),
            ],
        ),
        panel(
            "Evictions by tier",
            "Entries evicted per second to stay within a tier's budget.",
            "ops",
            [(rate("kvgate_document_kv_evictions_total", AT, "tier"), "{{tier}}")],
        ),
    ]


def semantic() -> list[dict[str, Any]]:
    lookups = "kvgate_cache_lookups_total"
    at = f'{AT}, layer="semantic"'
    return [
        panel(
            "Semantic cache lookups",
            "Per second, by result: hit (answered from the cache), miss, verify (a would-be hit the model "
            "answers, to check the error bound). Requests that may not be cached (temperature > 0, tools) bypass it.",
            "ops",
            [(rate(lookups, at, "result"), "{{result}}")],
        ),
        panel(
            "Semantic cache hit ratio",
            "Share of lookups answered from the cache.",
            "percentunit",
            [(share(rate(lookups, f'{at}, result="hit"'), rate(lookups, at)), "hits")],
        ),
        panel(
            "Semantic verdicts by category",
            "Answers judged against a cached one per second: right or wrong, per category.",
            "ops",
            [(rate("kvgate_semantic_verdicts_total", AT, "category, verdict"), "{{verdict}} {{category}}")],
        ),
        panel(
            "Semantic thresholds by category",
            "The verifier score each category is served from (above 1: only the same question), and its "
            "max_error_rate.",
            "short",
            [
                ("max by (category) (kvgate_semantic_threshold{" + AT + "})", "threshold {{category}}"),
                ("max by (category) (kvgate_semantic_max_error_rate{" + AT + "})", "max error {{category}}"),
            ],
        ),
    ]


def gate() -> list[dict[str, Any]]:
    def by_mode(metric: str) -> str:
        return f"max by (model, mode) ({metric}{{{AT}}})"

    return [
        panel(
            "Recompute ratio served",
            "Per reuse mode, the highest recompute ratio the quality gate serves (1: full prefill, reuse withheld).",
            "percentunit",
            [(by_mode("kvgate_reuse_gate_ratio"), "{{mode}} {{model}}")],
        ),
        panel(
            "First-token KL of shadow checks",
            "Mean KL(full prefill || reuse) of the first token: the latest checks at the ratio served, and all.",
            "short",
            [
                (by_mode("kvgate_reuse_fidelity_window_kl"), "latest {{mode}}"),
                (by_mode("kvgate_reuse_fidelity_kl"), "all {{mode}}"),
            ],
        ),
        panel(
            "Agreement with full prefill",
            "Share of checks whose first token agreed (latest, all), and the share of an answer's first 32 tokens "
            "that full prefill repeats.",
            "percentunit",
            [
                (by_mode("kvgate_reuse_fidelity_window_top1"), "top-1 latest {{mode}}"),
                (by_mode("kvgate_reuse_fidelity_top1"), "top-1 all {{mode}}"),
                (by_mode("kvgate_reuse_fidelity_answer"), "answer {{mode}}"),
            ],
        ),
        panel(
            "Shadow checks",
            "Reused requests checked against full prefill per second, by mode; those that came due, and those "
            "dropped because max_pending were waiting.",
            "ops",
            [
                (rate("kvgate_shadow_checks_total", AT, "mode"), "checked {{mode}}"),
                (rate("kvgate_shadow_due_total", AT), "due"),
                (rate("kvgate_shadow_dropped_total", AT), "dropped"),
            ],
        ),
        panel(
            "Reuse withheld",
            "Ladders (the mode's, and KVCOMM's per prompt shape) and those serving full prefill.",
            "short",
            [
                ("sum by (mode) (kvgate_reuse_gate_ladders{" + AT + "})", "ladders {{mode}}"),
                ("sum by (mode) (kvgate_reuse_gate_withheld{" + AT + "})", "withheld {{mode}}"),
            ],
        ),
        state(
            "Blend calibration",
            "Where blends' recompute ratio comes from: table, operator, shadow (opened online); calibrating, "
            "unmet or off: full prefill. Checks: of the ratio calibrating online.",
            [
                ("max by (state) (kvgate_blend_calibration{" + AT + "}) > 0", "{{state}}"),
                ("max(kvgate_blend_calibration_checks{" + AT + "})", "checks"),
            ],
        ),
    ]


def engine() -> list[dict[str, Any]]:
    return [
        panel(
            "Engine queue",
            "Sequences the engine runs, and those waiting for a slot.",
            "short",
            [
                ("sum(kvgate_requests_running{" + AT + "})", "running"),
                ("sum(kvgate_requests_waiting{" + AT + "})", "waiting"),
            ],
        ),
        panel(
            "Memory",
            "The process's resident memory; of it, document KV in the memory tier and KVCOMM's anchors.",
            "bytes",
            [
                ("sum by (instance) (process_resident_memory_bytes{" + AT + "})", "resident {{instance}}"),
                ('sum(kvgate_document_kv_bytes{tier="memory", ' + AT + "})", "document KV"),
                ("sum(kvgate_kvcomm_anchor_bytes{" + AT + "})", "KVCOMM anchors"),
            ],
        ),
        panel(
            "CPU",
            "CPU seconds per second of the process (cores busy).",
            "short",
            [(rate("process_cpu_seconds_total", AT, "instance"), "{{instance}}")],
        ),
        panel(
            "Agent programs",
            "Programs seen recently, those whose context is pinned, and those admitted and not ended.",
            "short",
            [
                ("sum(kvgate_programs{" + AT + "})", "seen"),
                ("sum(kvgate_pinned_programs{" + AT + "})", "pinned"),
                ("sum(kvgate_programs_in_flight{" + AT + "})", "in flight"),
            ],
        ),
        panel(
            "Agent turns",
            "Agent turns ended per second, and those that followed a tool call.",
            "ops",
            [
                (rate("kvgate_program_turns_total", AT), "turns"),
                (rate("kvgate_tool_returns_total", AT), "tool returns"),
            ],
        ),
        panel(
            "KVCOMM",
            "Spans reused with offsets from anchors, spans no anchor was close to (prefilled densely), and anchor "
            "evictions, per second; anchors held.",
            "ops",
            [
                (rate("kvgate_kvcomm_estimates_total", AT), "estimated"),
                (rate("kvgate_kvcomm_gated_total", AT), "gated"),
                (rate("kvgate_kvcomm_anchor_evictions_total", AT), "evicted"),
                ("sum(kvgate_kvcomm_anchors{" + AT + "})", "anchors"),
            ],
        ),
    ]


def build() -> dict[str, Any]:
    variables = [
        variable("job", "Job", "label_values(kvgate_requests_total, job)"),
        variable("instance", "Instance", 'label_values(kvgate_requests_total{job=~"$job"}, instance)'),
    ]
    rows = [
        ("Traffic", traffic()),
        ("Latency", latency()),
        ("Engine stages", stages()),
        ("Tokens", tokens()),
        ("KV reuse", reuse()),
        ("Document KV tiers", tiers()),
        ("Semantic cache", semantic()),
        ("Quality gate", gate()),
        ("Engine, memory and agents", engine()),
    ]
    about = (
        "One kvgate server (kvgate serve), or several alike. Over replicas behind fronts: kvgate-fleet.json; "
        "a front's own semantic cache and admission show here with its instance picked."
    )
    return dashboard("kvgate-server", "kvgate: server", about, variables, rows)

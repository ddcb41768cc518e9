"""Category-aware semantic response cache. Filled in by the semantic-cache issue."""

"""The model engine: loading, the layer loop over explicit KV, sampling, continuous batching."""

"""One instance's mechanics: service times, KV sizes, the prefill queue and decode batching."""

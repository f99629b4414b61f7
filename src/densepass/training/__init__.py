"""Fine-tuning a bi-encoder: batches, the loss step (with gradient caching), distributed, the loop."""

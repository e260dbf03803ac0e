"""Building blocks shared by the model files: norm, rotary embedding, paged attention, MoE."""

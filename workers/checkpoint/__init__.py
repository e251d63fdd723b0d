"""Model folders: the embedded default model, GGUF conversion and weight quantisation."""

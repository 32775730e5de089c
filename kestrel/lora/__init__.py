"""LoRA adapters served over one base model: loading and checking PEFT folders (adapter.py), the device
pool of adapter slots (pool.py), the segmented LoRA matmul (ops.py, triton_ops.py) and the projections
that apply it (layers.py). docs/lora.md describes the whole."""

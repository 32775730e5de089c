"""Tensor and expert parallelism on torch.distributed (NCCL on GPUs, gloo on the CPU)."""

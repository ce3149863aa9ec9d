"""The PyTorch backend: the scenario's ranks as processes (gloo on CPU, NCCL on GPUs)."""

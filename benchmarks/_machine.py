"""One line describing the machine, printed by every benchmark with its numbers."""
import os
import platform

import torch


def machine_line(device: str = "cpu") -> str:
    name = torch.cuda.get_device_name(0) if device == "cuda" and torch.cuda.is_available() else (
        platform.processor() or platform.machine())
    return (f"machine: cpus={os.cpu_count()}, torch threads={torch.get_num_threads()}, device={device} ({name}), "
            f"torch {torch.__version__}")

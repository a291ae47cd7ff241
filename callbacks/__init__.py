from .saturation import AmaxSaturationCallback
from .throughput import TokenThroughputMonitor
from .warmup import BF16WarmupCallback

__all__ = ["AmaxSaturationCallback", "BF16WarmupCallback", "TokenThroughputMonitor"]

from .progress_log import StepLogCallback
from .rng import RNGStateCallback
from .saturation import AmaxSaturationCallback
from .throughput import TokenThroughputMonitor
from .warmup import BF16WarmupCallback

__all__ = ["AmaxSaturationCallback", "BF16WarmupCallback", "RNGStateCallback", "StepLogCallback", "TokenThroughputMonitor"]

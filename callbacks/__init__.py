from .alarms import SpikeAlarm
from .dashboard import TensorBoardDashboard
from .fallback import FallbackCallback
from .forgetting import ForgettingMonitor
from .initial_eval import InitialEvaluationCallback
from .memory import MemoryMonitor
from .model_summary import QATModelSummary
from .noise_floor import NoiseFloorCallback
from .progress_log import StepLogCallback
from .quantized_modules import QuantizedModulesCallback
from .rng import RNGStateCallback
from .run_summary import RunSummaryCallback
from .saturation import AmaxSaturationCallback
from .step_progress import StepProgressBar
from .throughput import TokenThroughputMonitor
from .warmup import BF16WarmupCallback

__all__ = [
    "AmaxSaturationCallback", "BF16WarmupCallback", "FallbackCallback", "ForgettingMonitor", "InitialEvaluationCallback", "QATModelSummary",
    "QuantizedModulesCallback",
    "RNGStateCallback", "RunSummaryCallback", "StepLogCallback", "StepProgressBar", "TokenThroughputMonitor",
    "MemoryMonitor", "NoiseFloorCallback", "SpikeAlarm", "TensorBoardDashboard",
]

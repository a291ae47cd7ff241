from .forgetting import ForgettingMonitor
from .initial_eval import InitialEvaluationCallback
from .model_summary import QATModelSummary
from .progress_log import StepLogCallback
from .rng import RNGStateCallback
from .run_summary import RunSummaryCallback
from .saturation import AmaxSaturationCallback
from .step_progress import StepProgressBar
from .throughput import TokenThroughputMonitor
from .warmup import BF16WarmupCallback

__all__ = [
    "AmaxSaturationCallback", "BF16WarmupCallback", "ForgettingMonitor", "InitialEvaluationCallback", "QATModelSummary",
    "RNGStateCallback", "RunSummaryCallback", "StepLogCallback", "StepProgressBar", "TokenThroughputMonitor",
]

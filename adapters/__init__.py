"""Adapters between mars_plugin and the WSSS / USS codebases (installed as ``mars_plugin.adapters``).

Each adapter reads one upstream repository's outputs exactly as that repository writes them and
hands the core plain tensors. They arrive with their own issues; this package is the home.
"""

# The training hook is what every recipe imports: ``from mars_plugin.adapters import
# MARSTrainingHook`` (it lives in mars_plugin.adapters.training_hook).
from mars_plugin.adapters.training_hook import MARSTrainingHook  # noqa: E402

__all__ = ["MARSTrainingHook"]

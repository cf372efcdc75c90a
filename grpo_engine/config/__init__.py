"""The typed configuration tree of a training run: a leaf package (no torch, nothing from rl/, train/, model/).

One dataclass per section (algorithm.py, training.py, run.py); YAML maps 1:1 onto it (an inline section's keys
at its parent's level: algorithm.beta is algorithm.policy_loss.beta) and `key.sub=value` command-line overrides
patch it (load.py). Sections validate themselves in `__post_init__`; every field
documents itself in its metadata (docs.py writes docs/configuration.md from it).
"""

from .algorithm import (
    AdvantageConfig,
    AlgorithmSection,
    GroupFilterConfig,
    LossConfig,
    OverlongConfig,
    ReferenceConfig,
    SemanticEntropyConfig,
)
from .curriculum import CURRICULUM_MODES, CurriculumSection
from .docs import config_docs_markdown, iter_config_docs
from .fields import ConfigError
from .load import config_from_yaml_text, load_config, to_yaml
from .paths import check_paths
from .run import (
    CheckpointSection,
    CheckSection,
    Config,
    DistributedSection,
    EvalSection,
    LoggingSection,
    ModelSection,
    RolloutSection,
    TaskSection,
    TokenizerSection,
)
from .tools import TOOL_FORMATS, ToolsSection
from .training import (
    LoRAConfig,
    MemorySection,
    OptimizerSection,
    ScheduleSection,
    SFTConfig,
    TinyModelSection,
    WarmStartSection,
)

__all__ = [
    "AdvantageConfig", "AlgorithmSection", "CURRICULUM_MODES", "CheckSection", "CheckpointSection", "Config",
    "ConfigError",
    "CurriculumSection", "DistributedSection",
    "EvalSection",
    "GroupFilterConfig", "LoRAConfig", "LoggingSection", "LossConfig", "MemorySection",
    "ModelSection", "OptimizerSection", "OverlongConfig", "ReferenceConfig", "RolloutSection",
    "SFTConfig", "ScheduleSection", "SemanticEntropyConfig", "TOOL_FORMATS", "TaskSection", "TinyModelSection",
    "TokenizerSection", "ToolsSection",
    "WarmStartSection", "check_paths", "config_docs_markdown", "config_from_yaml_text", "iter_config_docs",
    "load_config", "to_yaml",
]

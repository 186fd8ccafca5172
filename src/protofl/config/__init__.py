"""Run configuration: one validated dataclass per component.

A config is built at the edge (``cli.py`` or the Python API) from YAML plus dotted
``key=value`` overrides, validated here, and passed down explicitly; nothing in the
library reads globals. Components chosen by name (dataset, partitioner, model,
algorithm) keep their own parameters next to the name and are validated against the
component's own signature (loaders, partitioners, models) or hyper-parameter dataclass
(algorithms), so one method's ``mu`` never leaks into another's namespace.

Every validation failure raises :class:`ConfigError` with the dotted key, the value and
what is allowed; the CLI prints that one line and exits with code 2.

The package, bottom to top (each module imports only the ones above it in this list):

* :mod:`.coerce`: YAML values against annotations and signatures;
* :mod:`.machine`: what a config needs from the machine (device, trackers' and Ray's
  packages);
* :mod:`.sections`: one dataclass per section, each checking its own fields;
* :mod:`.schema`: :class:`Config`, built by :func:`from_dict` from a mapping and dotted
  overrides and checked against the registries (methods, datasets, partitioners, feature
  skews, models: looked up here only) and the combinations that cannot work;
* :mod:`.files`: YAML files, the command line, the packaged example configs.

It sits above the components it names (algorithms, data, models) and below the engine,
which receives a :class:`Config` and never comes back here to validate.
"""
from ..errors import ConfigError, require
from .coerce import check_dataclass, check_kwargs, coerce, plain
from ..packaged_configs import (config_description, PACKAGED_CONFIGS, packaged_config, packaged_configs,
                               resolve_config_path)
from .files import config_from_args, defaults_yaml, load_config, yaml_problem
from .machine import available_devices, check_device, check_trackers, require_ray, TRACKERS
from .schema import (apply_overrides, BACKENDS, check_here, Config, from_dict, hyper, method, NAMED_SECTIONS,
                     parse_override, PLAIN_SECTIONS, switch_components, validate_components)
from .sections import (AlgorithmConfig, ceil_fraction, DataConfig, EvalConfig, ExecutionConfig, FeaturesConfig,
                       ModelConfig, OutputConfig, ParticipationConfig, PartitionConfig, PrivacyConfig,
                       TrainingConfig)

__all__ = [
    "AlgorithmConfig", "apply_overrides", "available_devices", "BACKENDS", "ceil_fraction", "check_dataclass",
    "check_device", "check_here", "check_kwargs", "check_trackers", "coerce", "Config", "config_description",
    "config_from_args", "ConfigError", "DataConfig", "defaults_yaml", "EvalConfig", "ExecutionConfig",
    "FeaturesConfig", "from_dict", "hyper", "load_config", "method", "ModelConfig", "NAMED_SECTIONS",
    "OutputConfig", "PACKAGED_CONFIGS", "packaged_config", "packaged_configs", "parse_override",
    "ParticipationConfig", "PartitionConfig", "PLAIN_SECTIONS", "PrivacyConfig", "plain", "require", "require_ray",
    "resolve_config_path", "switch_components", "TRACKERS", "TrainingConfig", "validate_components",
    "yaml_problem",
]

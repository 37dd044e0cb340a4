"""Named model sizes: data, not code branches.

Each architecture declares its own (``ArchSpec.sizes``, in ``oases/config/archs/``);
this is the lookup over all registered ones. An entry gives every shape field of
:class:`oases.config.ModelConfig`; a YAML file or override may still change any single
field (``model.n_layer=2``). ``ffn_hidden`` is the width of the MLP's hidden layer (for
SwiGLU, of each of the gate and up projections). Fields a size leaves out take
ModelConfig's defaults (plain RoPE, no sliding window).
"""

from __future__ import annotations

import difflib

from oases.config.archs import find_arch, arch_names
from oases.errors import ConfigError


def model_sizes() -> dict[str, dict]:
    """Every registered size: name -> its fields, ``arch`` included."""
    return {name: dict(fields, arch=a) for a in arch_names()
            for name, fields in find_arch(a).sizes.items()}


def find_size(name: str) -> dict:
    """The fields of size ``name``; an unknown name is a ConfigError naming the near miss."""
    sizes = model_sizes()
    if name not in sizes:
        near = difflib.get_close_matches(name, sizes, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ConfigError(f"model.name={name!r} is not a known size{hint}; "
                          f"known: {', '.join(sizes)}")
    return sizes[name]

"""The architectures by name (``model.arch``): one :class:`~oases.config.arch.ArchSpec`
each, registered once. The built-in ones have a file each here; a project's own
registers its spec with :func:`register_arch` before its config is loaded
(docs/custom-blocks.md, "New architectures").

    get_arch("qwen2").qkv_bias  ->  True
"""

from __future__ import annotations

import difflib
from typing import Optional

from oases.config.arch import ArchSpec
from oases.config.archs import gpt, llama, mistral, qwen2
from oases.errors import ConfigError

_SPECS: dict[str, ArchSpec] = {}


def register_arch(spec: ArchSpec) -> ArchSpec:
    """Make ``spec`` known as ``model.arch=spec.name``. A name, a named size or a Hugging
    Face class another architecture already has is an error."""
    if spec.name in _SPECS:
        raise ValueError(f"architecture {spec.name!r} is already registered")
    for other in _SPECS.values():
        clash = sorted(set(spec.sizes) & set(other.sizes))
        if clash:
            raise ValueError(f"architecture {spec.name!r}: size {clash[0]!r} is already "
                             f"arch {other.name!r}'s")
        if spec.hf is not None and other.hf is not None and (
                spec.hf.architecture == other.hf.architecture
                or spec.hf.model_type == other.hf.model_type):
            raise ValueError(f"architecture {spec.name!r}: Hugging Face "
                             f"{spec.hf.architecture} ({spec.hf.model_type}) is already "
                             f"arch {other.name!r}'s")
    _SPECS[spec.name] = spec
    return spec


def unregister_arch(name: str) -> None:
    """Forget architecture ``name`` (a test's or a plugin's that is done)."""
    _SPECS.pop(name, None)


def arch_names() -> tuple[str, ...]:
    """The registered architectures, in registration order."""
    return tuple(_SPECS)


def find_arch(name: Optional[str]) -> Optional[ArchSpec]:
    """The spec of ``name``, or None."""
    return _SPECS.get(name) if name is not None else None


def get_arch(name: str) -> ArchSpec:
    """The spec of ``name``; an unknown name is a ConfigError naming the near miss."""
    spec = _SPECS.get(name)
    if spec is None:
        near = difflib.get_close_matches(str(name), _SPECS, n=1)
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise ConfigError(f"model.arch={name!r} is not one of {', '.join(_SPECS)}{hint}")
    return spec


def hf_archs() -> tuple[ArchSpec, ...]:
    """The architectures with a Hugging Face mapping, in registration order."""
    return tuple(s for s in _SPECS.values() if s.hf is not None)


# the built-in architectures: a file here and a place in this tuple each
for _spec in (gpt.SPEC, llama.SPEC, qwen2.SPEC, mistral.SPEC):
    register_arch(_spec)

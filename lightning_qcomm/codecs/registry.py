"""The codec registry: every codec name with its class, allowed bits, options and defaults.

Each codec class registers itself once, ``@register_codec(name, bits=range(...), options={...})``; every
list of allowed names, bits or options in the codec layer and the kernels (``get_codec``, ``CODEC_NAMES``,
their error messages, the classes' bit checks) is read from here. The layers above derive theirs with
``codec_names`` / ``codec_spec``.

"No compression" has one spelling: the entry ``"none"`` (``NO_COMPRESSION``, family ``"none"``, bits 32, no
class). ``resolve_codec(name, bits, ...)`` builds a codec or returns None for it; ``get_codec`` builds codecs
only.

Families: ``"quantizer"`` (b-bit quantizers of each element: uniform, the norm codecs, fp8), ``"sign"`` (the
1-bit sign compressor, biased, for error feedback), ``"none"``.

Example::

    >>> codec_names()                                       # CODEC_NAMES
    ('uniform', 'qsgd', 'qsgdinf', 'nuqsgd', 'sign1', 'fp8_e4m3', 'fp8_e5m2')
    >>> codec_names(family="quantizer", with_none=True)[-2:]
    ('fp8_e5m2', 'none')
    >>> codec_spec("qsgd").bits
    range(2, 9)
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

NO_COMPRESSION = "none"
FAMILIES = ("quantizer", "sign", NO_COMPRESSION)
UNCOMPRESSED_BITS = 32


@dataclass(frozen=True)
class CodecSpec:
    """What a codec name means: the class and the arguments its constructor allows.

    ``options`` maps each option to its allowed values, the first being the default; ``fixed`` holds the
    constructor arguments the name implies (fp8's ``fmt``); ``kernels``: the class has the native C and
    Triton kernels (``Codec.kernel_spec``), else every device runs its torch reference.
    ``bucket_size_by_bits``: widths whose default bucket differs from ``default_bucket_size`` (``default_bucket``).
    """

    name: str
    cls: type | None
    bits: range
    default_bits: int
    default_bucket_size: int | None
    family: str
    options: Mapping[str, tuple] = field(default_factory=dict)
    fixed: Mapping[str, Any] = field(default_factory=dict)
    kernels: bool = False
    bucket_size_by_bits: Mapping[int, int] = field(default_factory=dict)

    def default_bucket(self, bits: int | None = None) -> int | None:
        """The bucket ``build`` gives a codec of ``bits`` (None: the default width) when none is asked for."""
        bits = self.default_bits if bits is None else bits
        return self.bucket_size_by_bits.get(bits, self.default_bucket_size)

    def build(self, bits: int | None = None, bucket_size: int | None = None, **opts: Any):
        """The codec, with the defaults for ``bits`` / ``bucket_size`` None; unknown options are a TypeError."""
        if self.cls is None:
            raise ValueError(
                f"codec {self.name!r} means no compression: there is no codec object to build; "
                "resolve_codec returns None for it"
            )
        extra = set(opts) - set(self.options)
        if extra:
            raise TypeError(
                f"codec {self.name!r} got unexpected option(s) {sorted(extra)}; allowed: {sorted(self.options)}"
            )
        bits = self.default_bits if bits is None else bits
        bucket = self.default_bucket(bits) if bucket_size is None else bucket_size
        return self.cls(bits, bucket, **self.fixed, **opts)


_REGISTRY: dict[str, CodecSpec] = {
    NO_COMPRESSION: CodecSpec(NO_COMPRESSION, None, range(32, 33), UNCOMPRESSED_BITS, None, NO_COMPRESSION)
}


def register_codec(
    name: str,
    *,
    bits: range,
    default_bits: int | None = None,
    bucket_size: int | None = 512,
    bucket_size_by_bits: Mapping[int, int] | None = None,
    options: Mapping[str, Iterable] | None = None,
    family: str = "quantizer",
    kernels: bool = False,
    **fixed: Any,
):
    """Class decorator: register ``cls`` under ``name`` (lower case) and set its bit range from ``bits``.

    ``default_bits`` (default: the largest allowed), ``bucket_size``: ``get_codec``'s defaults, and
    ``bucket_size_by_bits`` the widths whose default bucket is another (a codec whose error grows with the bucket
    at few bits); ``options``:
    allowed values per constructor option, the first the default; ``fixed``: constructor arguments implied by
    the name. A class may be registered under several names (fp8's two formats) with one bit range.

    Example::

        @register_codec("mycodec", bits=range(1, 9), options={"stochastic": (True, False)})
        class MyCodec(Codec): ...
    """
    key = name.lower()
    if family not in FAMILIES[:-1]:
        raise ValueError(f"family={family!r} is not a codec family; allowed: {', '.join(FAMILIES[:-1])}")
    if not isinstance(bits, range) or len(bits) == 0 or bits.step != 1:
        raise ValueError(f"bits must be a non-empty range of step 1, got {bits!r}")
    opts = {k: tuple(v) for k, v in (options or {}).items()}
    by_bits = dict(bucket_size_by_bits or {})
    if set(by_bits) - set(bits):
        raise ValueError(f"bucket_size_by_bits has widths {sorted(set(by_bits) - set(bits))} outside bits {bits!r}")

    def decorate(cls: type) -> type:
        if key in _REGISTRY and _REGISTRY[key].cls is not cls:
            raise ValueError(f"codec name {key!r} is already registered to {_REGISTRY[key].cls!r}")
        own = cls.__dict__.get("min_bits"), cls.__dict__.get("max_bits")
        if own != (None, None) and own != (bits.start, bits.stop - 1):
            raise ValueError(f"{cls.__name__} is registered with bits {own[0]}..{own[1]}, not {bits!r}")
        cls.min_bits, cls.max_bits = bits.start, bits.stop - 1
        default = bits.stop - 1 if default_bits is None else default_bits
        _REGISTRY[key] = CodecSpec(key, cls, bits, default, bucket_size, family, opts, dict(fixed), kernels, by_bits)
        codec_for_op.cache_clear()
        return cls

    return decorate


def unregister(name: str) -> None:
    """Remove a registered codec (tests, plugins that replace one); ``"none"`` stays."""
    if name == NO_COMPRESSION:
        raise ValueError(f"{NO_COMPRESSION!r} cannot be unregistered")
    _REGISTRY.pop(name.lower(), None)
    codec_for_op.cache_clear()


def codec_names(family: str | Iterable[str] | None = None, *, with_none: bool = False) -> tuple[str, ...]:
    """Registered codec names in registration order, of ``family`` (a name or several; None: all), then
    ``"none"`` when ``with_none``.

    Example::

        codec_names("quantizer")          # e.g. ("nuqsgd", "qsgd", "qsgdinf", "uniform", ...)
    """
    fams = set(FAMILIES[:-1]) if family is None else {family} if isinstance(family, str) else set(family)
    unknown = fams - set(FAMILIES)
    if unknown:
        raise ValueError(f"family={sorted(unknown)} is not a codec family; allowed: {', '.join(FAMILIES)}")
    names = tuple(n for n, s in _REGISTRY.items() if s.family in fams - {NO_COMPRESSION})
    return (*names, NO_COMPRESSION) if with_none or NO_COMPRESSION in fams else names


def codec_spec(name: str) -> CodecSpec:
    """The registry entry of ``name`` (case-insensitive), ``"none"`` included.

    Example::

        codec_spec("uniform").bits        # the allowed widths, a range
    """
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    spec = _REGISTRY.get(name.lower())
    if spec is None:
        raise ValueError(f"unknown codec name {name!r}; allowed: {', '.join(codec_names(with_none=True))}")
    return spec


def allowed_bits(name: str) -> str:
    """The widths codec ``name`` takes, as users read them: ``"2..8"``, ``"8"``, ``"32"`` (``"none"``)."""
    bits = codec_spec(name).bits
    return str(bits.start) if len(bits) == 1 else f"{bits.start}..{bits.stop - 1}"


def check_codec_bits(
    owner: str, bits: Any, codec: str, *, bits_arg: str = "bits", codec_arg: str = "codec", also: str = ""
) -> int:
    """``bits`` checked against codec ``codec``'s own widths, before any generic bound: ``TypeError`` for a
    non-int, ``ValueError`` for a width the codec lacks. Both name ``owner``, the argument as the user spelled it
    (``bits_arg``: ``"bits"`` when that set the width) and the codec's range; ``also`` adds other allowed values
    (e.g. ``", or 32 for unquantized"``).

    Example::

        check_codec_bits("QuantDDPStrategy", 0, "nuqsgd")
        # ValueError: QuantDDPStrategy(bits=0) is not supported by codec='nuqsgd'; allowed: 2..8
    """
    allowed = allowed_bits(codec)
    if not isinstance(bits, int) or isinstance(bits, bool):
        raise TypeError(
            f"{owner}({bits_arg}={bits!r}) must be an int, got {type(bits).__name__}; allowed for "
            f"{codec_arg}={codec.lower()!r}: {allowed}{also}"
        )
    if bits not in codec_spec(codec).bits:
        raise ValueError(
            f"{owner}({bits_arg}={bits!r}) is not supported by {codec_arg}={codec.lower()!r}; allowed: {allowed}{also}"
        )
    return bits


def resolve_codec(name: str, bits: int | None = None, bucket_size: int | None = None, **opts: Any):
    """``get_codec(name, bits, bucket_size, **opts)``, or None for ``"none"`` (bits None or 32, no options;
    ``bucket_size`` has no meaning there and is ignored).

    Example::

        resolve_codec("none")                 # None: no compression
        resolve_codec("uniform", bits=8)      # the same codec as get_codec("uniform", bits=8)
    """
    spec = codec_spec(name)
    if spec.cls is not None:
        return spec.build(bits, bucket_size, **opts)
    if bits is not None and bits not in spec.bits:
        raise ValueError(f"bits={bits} is not supported by codec {spec.name!r} (no compression): allowed 32")
    if opts:
        raise TypeError(f"codec {spec.name!r} got unexpected option(s) {sorted(opts)}; allowed: []")
    return None


def has_kernels(codec: object) -> bool:
    """True when ``codec`` is exactly the class registered under its name and that class has the native
    kernels (a subclass may override the math, so it keeps its own torch reference)."""
    spec = _REGISTRY.get(getattr(codec, "name", None))
    return spec is not None and spec.kernels and type(codec) is spec.cls


def is_registered(codec: object) -> bool:
    """True when ``codec`` is exactly the class registered under its name (so the ops can carry it)."""
    spec = _REGISTRY.get(getattr(codec, "name", None))
    return spec is not None and type(codec) is spec.cls


@functools.lru_cache(maxsize=256)
def codec_for_op(name: str, bits: int, bucket_size: int | None, stochastic: bool):
    """The codec the ops' arguments ``(codec, bits, bucket_size, stochastic)`` stand for (``Codec.op_args``).

    ``bucket_size`` None is the codec's own value (one bucket), not "the default": built by the class, not
    ``CodecSpec.build``."""
    spec = codec_spec(name)
    return spec.cls(bits, bucket_size, **spec.fixed, **spec.cls.op_options(stochastic))

"""The metric-name scheme, in one place: the producers build names here and the report reads them back here.

Per-domain metrics are `<group>/<stat>/<domain>` (`reward/mean/swe`); `all` as the domain means every
domain's episodes together; batch-wide metrics have no domain part (`train/grad_norm`). MoE telemetry adds
two indexed families, `moe/load_e<EEE>/<domain>` (expert load) and `moe/max_vio_l<LL>/<domain>` (MaxVio per
layer). The producers (rl/observe/telemetry.py, rl/observe/moe.py) write through `per_domain`, `moe_load`
and `max_vio_layer`; the report's loader (rl/observe/report_data.py) turns a run's keys into typed indexes
with `split_domain` and `moe_index`, so no chart or table takes a name apart.

Which names are domains is never decided here: that is the run record's job (rl/observe/record.py).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Literal, Mapping

ALL = "all"  # the domain part of a metric over every domain's episodes together

_MOE = re.compile(r"^moe/(?:load_e(\d+)|max_vio_l(\d+))/(.+)$")


def per_domain(stat: str, domain: str) -> str:
    """`reward/mean` + `swe` -> `reward/mean/swe`."""
    return f"{stat}/{domain}"


def moe_load(expert: int, domain: str) -> str:
    return f"moe/load_e{expert:03d}/{domain}"


def max_vio_layer(layer: int, domain: str) -> str:
    return f"moe/max_vio_l{layer:02d}/{domain}"


def split_domain(key: str, domains: Iterable[str]) -> tuple[str, str] | None:
    """(stat, domain) when `key` is `<stat>/<domain>` for one of `domains` (or `all`), else None.

    `domains` should be a set: name suffixes are looked up in it, so the cost does not grow with the
    number of domains. A domain name may itself hold `/` (`reward/mean/web/search`): suffixes are tried
    from the last part outwards and the shortest one that is a domain wins."""
    dom = domains if isinstance(domains, (set, frozenset, Mapping)) else set(domains)
    i = key.rfind("/")
    if i > 0 and key[i + 1:] == ALL:
        return key[:i], ALL
    while i > 0:
        if key[i + 1:] in dom:
            return key[:i], key[i + 1:]
        i = key.rfind("/", 0, i)
    return None


@dataclass(frozen=True)
class MoeKey:
    kind: Literal["load", "max_vio"]
    index: int   # expert id for "load", MoE layer for "max_vio"
    domain: str  # a domain name or `all`


def moe_index(key: str) -> MoeKey | None:
    """The parts of a `moe/load_e<EEE>/<domain>` or `moe/max_vio_l<LL>/<domain>` name; None for any other name."""
    m = _MOE.match(key)
    if m is None:
        return None
    if m.group(1) is not None:
        return MoeKey("load", int(m.group(1)), m.group(3))
    return MoeKey("max_vio", int(m.group(2)), m.group(3))


def legacy_domains(keys: Iterable[str]) -> tuple[str, ...]:
    """For runs written before the run record existed: the domains with a `reward/mean/<domain>` series
    (the driver logs one for every domain it rolled out), `all` excluded."""
    pre = per_domain("reward/mean", "")
    return tuple(sorted(k[len(pre):] for k in keys if k.startswith(pre) and k != per_domain("reward/mean", ALL)))

"""What one cell row of the MLX bench measures: a workload at one length (`--max-tokens 200,1000`),
its messages, its earlier requests, and for the structured set (`--structured`) its JSON Schema;
and the check of an output against that schema.

A case's label is the workload's name, or `name@N` when the run asks for several lengths, so the
JSON keeps one row per arm and label as before."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field

from skulkp2p.bench.bench_error import BenchError
from skulkp2p.bench.workloads import SESSIONS, STRUCTURED, WORKLOADS

# A schema as the bench holds it (plain JSON values: dicts, lists, strings, numbers).
Schema = dict


@dataclass(frozen=True)
class Case:
    label: str
    workload: str
    max_tokens: int
    messages: list[dict[str, str]]
    schema: Schema | None = None  # the structured set: every constrained arm's format
    setup: Sequence[list[dict[str, str]]] = field(default_factory=tuple)


def bench_cases(workloads: Sequence[str], lengths: Sequence[int],
                first_seen: bool = False) -> list[Case]:
    """The cases of a run, workload by workload, each at every length. `first_seen`: no earlier
    requests (a session's or a retry's turns would let the drafter copy what it saw)."""
    cases = []
    for wl in workloads:
        if wl in STRUCTURED:
            messages, schema = STRUCTURED[wl]
        else:
            messages, schema = WORKLOADS[wl], None
        setup = () if first_seen else tuple(SESSIONS.get(wl, ()))
        for n in lengths:
            label = f"{wl}@{n}" if len(lengths) > 1 else wl
            cases.append(Case(label, wl, n, messages, schema, setup))
    return cases


def require_jsonschema() -> None:
    """The structured set checks every output with jsonschema: refuse before minutes of work."""
    try:
        import jsonschema  # noqa: F401
    except ImportError:
        raise BenchError("--structured validates outputs with jsonschema, which is not "
                         "installed (pip install jsonschema)") from None


def valid_against(text: str, schema: Schema) -> bool:
    """Whether `text` is one JSON value that `schema` accepts (Draft 2020-12 rules, formats not
    asserted), checked independently of the grammar the engine decoded with."""
    import jsonschema

    try:
        value = json.loads(text)
    except ValueError:
        return False
    validator = jsonschema.Draft202012Validator(schema)
    return validator.is_valid(value)

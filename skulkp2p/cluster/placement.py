"""Placement: which ring of nodes serves each model, and which layers each member holds.

A pure function of shared state (model specs, node offers, previous placements), so every node
that runs it on the same inputs gets the same answer; the leader runs it and stamps the result
with its term.

For one model:

- a member holding ``n`` of the model's ``L`` layers needs
  ``n/L * size_bytes * overhead * s + n * kv_per_layer * s`` bytes, where ``overhead`` (about
  1.3 for MLX) covers activations and allocator slack, ``kv_per_layer`` is a KV cache for the
  card's whole context, and ``s`` scales bfloat16 sizes to the dtype that node runs in;
- candidate rings are tried smallest first (fewer hops: faster decode, more room for
  speculation); among the fitting rings of the smallest size the one with the most free memory
  wins, then the larger smallest headroom, then names (for determinism);
- layers are split contiguously in proportion to each member's free memory, at least one each
  (largest remainder rounding);
- a model whose tail of layers must stay together on the deciding (last) stage (``tail_start``:
  Gemma 4, whose KV-shared layers read their source layer's K/V within one call and whose
  assistant drafter reads those layers' caches) gets that tail on its last member, the member
  with the most free memory, and the layers before it split over the others;
- a model that fits nowhere gets a PlacementError that says how much it needs and what the
  cluster has.

A model whose card or placement request says ``parallel = "tensor"`` is placed tensor-parallel
instead: every member holds a slice of every layer (engine/parallel/tensor/shard.py), so each needs
``1/N`` of the weights and of the KV cache; the group is the smallest one of at least two nodes
that fits (at most one member per KV head), and its first member runs the decode loop.
``"pipeline"`` and ``"auto"`` (the default) place rings as above.

Several models are placed one after another (previous placements first, then new ones by id);
each takes its share of memory before the next is placed.

Replicas (``ModelSpec.replicas``, from the card's ``placement.replicas`` or the place request):
a model may be served by several independent rings or groups, each a whole copy placed as
above on nodes no other replica of it uses. Every model's first replica is placed before any
model's extra ones (one model's copies never crowd out another model); ``AUTO_REPLICAS`` asks for
one more replica on every node that asked for the model (its ``--model``) and fits it alone. A
replica stays where it is while its nodes live; one whose node is lost is placed again (or
dropped while nothing fits), the others untouched. Fewer replicas than asked is not an error.

A request pinned to named nodes some of which are away (``Request.pinned``, the owner decides
what away means) is placed automatically meanwhile, as a pipeline ring if a tensor-parallel
group does not fit the nodes there are, and its placement carries a ``note`` that says so; once
they are all back the owner pins it again and it moves back.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from skulkp2p.wire import Message, WireValue, as_int

if TYPE_CHECKING:
    from skulkp2p.models.cards import Card

OVERHEAD = 1.3
DTYPE_SCALE = {"bfloat16": 1.0, "float16": 1.0, "float32": 2.0}  # vs bf16 card sizes
MAX_COMBINATIONS = 4096  # beyond this many rings of one size, only the largest nodes are tried
PARALLEL = ("auto", "pipeline", "tensor")
AUTO_REPLICAS = -1  # ModelSpec.replicas: one on every node that asked for the model and fits it
MAX_REPLICAS = 64


class PlacementError(Exception):
    """A model that cannot be placed; the message names what it needs and what there is."""

    def __init__(self, model: str, message: str, needs: int = 0, available: int = 0):
        super().__init__(message)
        self.model = model
        self.needs = needs
        self.available = available


@dataclass(frozen=True)
class ModelSpec:
    """What placement needs to know about a model (from its card or its config.json)."""

    id: str
    layers: int
    size_bytes: int
    context_length: int = 4096
    hidden_size: int = 0
    kv_heads: int = 0
    head_dim: int = 0  # 0: estimated from hidden_size
    source: str = ""  # what a node loads it by: a card id, or a folder path (default: id)
    engine: str = ""  # "llama_server": one node that offers that engine; "" / "mlx": any ring
    parallel: str = ""  # "tensor": a tensor-parallel group; "" / "auto" / "pipeline": a ring
    tail_start: int = 0  # the last stage starts at or before this layer (0: anywhere)
    # KV tokens the engine allocates up front, when not the context length: a llama-server
    # child with N parallel slots holds N slots' contexts (-c is N x the slot context).
    kv_tokens: int = 0
    engine_reason: str = ""  # why this engine (a model with both forms: the asking node's choice)
    replicas: int = 0  # independent copies wanted (0 or 1: one; AUTO_REPLICAS: see the module)

    def kv_bytes_per_layer(self) -> int:
        """bf16 K and V of one layer for the whole context (every slot's, when served)."""
        head_dim = self.head_dim or (64 if self.hidden_size < 1536 else 128)
        return 2 * self.kv_heads * head_dim * (self.kv_tokens or self.context_length) * 2

    def to_dict(self) -> Message:
        return {"id": self.id, "layers": self.layers, "size_bytes": self.size_bytes,
                "context_length": self.context_length, "hidden_size": self.hidden_size,
                "kv_heads": self.kv_heads, "head_dim": self.head_dim, "source": self.source,
                **({"engine": self.engine} if self.engine else {}),
                **({"parallel": self.parallel} if self.parallel else {}),
                **({"tail_start": self.tail_start} if self.tail_start else {}),
                **({"kv_tokens": self.kv_tokens} if self.kv_tokens else {}),
                **({"engine_reason": self.engine_reason} if self.engine_reason else {}),
                **({"replicas": self.replicas} if self.replicas else {})}

    @classmethod
    def from_dict(cls, d: Mapping[str, WireValue]) -> ModelSpec:
        ints = ("layers", "size_bytes", "context_length", "hidden_size", "kv_heads", "head_dim",
                "tail_start", "kv_tokens", "replicas")
        model_id = d.get("id")
        given = {k: d[k] for k in ints if k in d}
        numbers = {k: v for k, v in given.items()
                   if isinstance(v, int) and not isinstance(v, bool)}
        if not isinstance(model_id, str) or len(numbers) != len(given):
            raise ValueError(f"bad model spec {dict(d)!r}")
        source = d.get("source", "")
        if not isinstance(source, str):
            raise ValueError(f"bad model spec source {source!r}")
        engine = d.get("engine", "")
        if not isinstance(engine, str):
            raise ValueError(f"bad model spec engine {engine!r}")
        parallel = d.get("parallel", "")
        if not isinstance(parallel, str) or parallel not in ("", *PARALLEL):
            raise ValueError(f"bad model spec parallel {parallel!r}")
        reason = d.get("engine_reason", "")
        if not isinstance(reason, str):
            raise ValueError(f"bad model spec engine_reason {reason!r}")
        spec = cls(model_id, **numbers, source=source, engine=engine, parallel=parallel,
                   engine_reason=reason)
        if spec.layers <= 0 or spec.size_bytes <= 0:
            raise ValueError(f"model spec {spec.id}: layers and size_bytes must be positive")
        if spec.kv_tokens < 0:
            raise ValueError(f"model spec {spec.id}: kv_tokens must not be negative")
        if not 0 <= spec.tail_start < spec.layers:
            raise ValueError(f"model spec {spec.id}: tail_start must be in [0, layers)")
        if not (spec.replicas == AUTO_REPLICAS or 0 <= spec.replicas <= MAX_REPLICAS):
            raise ValueError(f"model spec {spec.id}: replicas must be in [0, {MAX_REPLICAS}] "
                             "or auto")
        return spec

    @classmethod
    def from_card(cls, card: Card) -> ModelSpec:
        engine = "" if getattr(card, "engine", "mlx") == "mlx" else card.engine
        return cls(card.id, card.layers, card.size_bytes, card.context_length,
                   card.hidden_size, card.kv_heads, source=card.id, engine=engine,
                   parallel=_card_parallel(card),
                   tail_start=int(getattr(card, "tail_start", 0)),
                   kv_tokens=(card.served_slots() * card.served_slot_context
                              if engine == "llama_server" else 0),
                   replicas=_card_replicas(card))

    @property
    def tensor(self) -> bool:
        return self.parallel == "tensor"


    @property
    def one_copy(self) -> ModelSpec:
        """The spec without its replica count: what each replica is placed as."""
        return dataclasses.replace(self, replicas=0) if self.replicas else self


def parse_replicas(value: object) -> int:
    """A replica count as a card or a place request gives it: a number from 1 to MAX_REPLICAS
    or "auto" (AUTO_REPLICAS). Raises ValueError saying what is allowed."""
    if value == "auto":
        return AUTO_REPLICAS
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_REPLICAS:
        return value
    raise ValueError(f"'replicas' must be a number from 1 to {MAX_REPLICAS} or \"auto\", "
                     f"got {value!r}")


def _card_replicas(card: Card) -> int:
    value = (getattr(card, "placement", None) or {}).get("replicas")
    count = 0 if value is None else parse_replicas(value)
    return 0 if count == 1 else count  # one copy is the default, spelled one way


def _card_parallel(card: Card) -> str:
    value = (getattr(card, "placement", None) or {}).get("parallel", "auto")
    return "" if value == "auto" else value


@dataclass(frozen=True)
class NodeOffer:
    """A node as placement sees it: its name and the memory it offers."""

    name: str
    memory: int  # usable bytes (capped by --memory-limit)
    dtype: str = "bfloat16"  # what the node runs models in (float32 on Linux CPU + OpenBLAS)
    engines: tuple[str, ...] = ()  # what it gossips it can run (mlx-cpu, llama_server, ...)


@dataclass(frozen=True)
class Placement:
    model: str
    ring: tuple[str, ...]
    layers: tuple[tuple[int, int], ...]  # [start, end) per ring member, contiguous
    needs: tuple[int, ...] = ()  # bytes each member holds for it
    spec: ModelSpec | None = field(default=None, compare=False)
    explicit: bool = False  # the ring was named by the request ("nodes")
    term: int = 0
    # "pipeline": layers split along the ring, the last member runs the decode loop;
    # "tensor": every member holds a slice of every layer, the first runs the decode loop.
    parallel: str = "pipeline"
    # The leader's placement version when it made this placement (kept while the placement
    # is): a tensor group formed for it is told apart from one formed for an earlier
    # placement on the same nodes.
    serial: int = 0
    # A request pinned to nodes some of which are away, placed elsewhere meanwhile: those
    # nodes, and a line that says so.
    pinned: tuple[str, ...] = ()
    note: str = ""
    # The model's other replicas: whole copies on other nodes, each a placement of its own
    # (no spec, no replicas of their own). This one is the first.
    replicas: tuple[Placement, ...] = ()

    @property
    def entry(self) -> str:
        """The member that runs the decode loop and serves the model's requests."""
        return self.ring[0] if self.parallel == "tensor" else self.ring[-1]

    def copies(self) -> tuple[Placement, ...]:
        """Every replica, this first (without its list of the others)."""
        if not self.replicas:
            return (self,)
        return (dataclasses.replace(self, replicas=()), *self.replicas)

    def replica_for(self, node: str) -> Placement | None:
        """The replica ``node`` is a member of (a node holds at most one), else None."""
        return next((r for r in self.copies() if node in r.ring), None)

    @property
    def entries(self) -> tuple[str, ...]:
        """The member that runs the decode loop of each replica."""
        return tuple(r.entry for r in self.copies())

    @property
    def holders(self) -> tuple[str, ...]:
        """Every node holding some of the model, in any replica."""
        return tuple(n for r in self.copies() for n in r.ring)

    def surviving(self, lost: Callable[[str], bool]) -> Placement | None:
        """The replicas none of whose members is ``lost``, the first of them first; None when
        every replica lost a member."""
        copies = self.copies()
        kept = [r for r in copies if not any(lost(n) for n in r.ring)]
        if not kept:
            return None
        if kept[0] is copies[0]:
            return dataclasses.replace(self, replicas=tuple(kept[1:]))
        # the first replica is lost: the next one stands in its place (a ring named by the
        # request was the first, so this one was placed automatically)
        return dataclasses.replace(kept[0], spec=self.spec, pinned=self.pinned, note=self.note,
                                   explicit=False, replicas=tuple(kept[1:]))

    def to_dict(self) -> Message:
        d: Message = {"model": self.model, "ring": list(self.ring),
                      "layers": [list(r) for r in self.layers],
                      "needs": list(self.needs), "term": self.term,
                      "explicit": self.explicit, "parallel": self.parallel,
                      "serial": self.serial}
        if self.pinned:
            d["pinned"] = list(self.pinned)
            d["note"] = self.note
        if self.spec is not None:
            d["spec"] = self.spec.to_dict()
        if self.replicas:
            d["replicas"] = [r.to_dict() for r in self.replicas]
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, WireValue]) -> Placement:
        """A placement off the wire (or the state file); raises TypeError, ValueError or
        KeyError on one that is malformed."""
        spec_d = d.get("spec")
        spec = ModelSpec.from_dict(spec_d) if isinstance(spec_d, dict) else None
        return cls(str(d["model"]), tuple(str(n) for n in _items(d["ring"])),
                   tuple((as_int(a), as_int(b)) for a, b in map(_items, _items(d["layers"]))),
                   tuple(as_int(x) for x in _items(d.get("needs", []))), spec,
                   bool(d.get("explicit")), as_int(d.get("term", 0)),
                   "tensor" if d.get("parallel") == "tensor" else "pipeline",
                   as_int(d.get("serial", 0)),
                   tuple(str(n) for n in _items(d.get("pinned", []))), str(d.get("note", "")),
                   tuple(dataclasses.replace(cls.from_dict(r), spec=None, replicas=())
                         for r in _items(d.get("replicas", [])) if isinstance(r, dict)))


def _items(value: WireValue) -> list[WireValue]:
    if not isinstance(value, list):
        raise TypeError(f"expected a list, got {type(value).__name__}")
    return value



@dataclass(frozen=True)
class Request:
    spec: ModelSpec
    nodes: tuple[str, ...] = ()  # an explicit ring, in order; empty: choose
    only: tuple[str, ...] = ()  # choose among these nodes only (a model on their disks alone)
    # The ring it is pinned to while some of those nodes are away (``nodes`` is then empty):
    # placed automatically meanwhile, with a note saying so.
    pinned: tuple[str, ...] = ()
    # The nodes that asked for the model (their --model): where AUTO_REPLICAS puts copies.
    askers: tuple[str, ...] = ()

    def specs(self) -> list[ModelSpec]:
        """What it may be placed as: its spec; while its pinned nodes are away, a
        tensor-parallel spec also as a pipeline ring (a node left alone still serves it)."""
        if self.pinned and self.spec.tensor:
            return [self.spec, dataclasses.replace(self.spec, parallel="pipeline")]
        return [self.spec]


def split_layers(layers: int, weights: Sequence[float]) -> list[tuple[int, int]]:
    """Contiguous [start, end) ranges, sizes proportional to ``weights``, at least one each."""
    k = len(weights)
    if k == 0 or k > layers:
        raise ValueError(f"cannot split {layers} layers over {k} nodes")
    total = float(sum(weights))
    quotas = [layers * w / total if total > 0 else layers / k for w in weights]
    counts = [max(1, math.floor(q)) for q in quotas]
    # Take back from the largest shares if the minimum of one pushed us over.
    while sum(counts) > layers:
        i = max((j for j in range(k) if counts[j] > 1), key=lambda j: (counts[j] - quotas[j], j))
        counts[i] -= 1
    # Hand out the rest by largest remainder; ties to the earlier member.
    order = sorted(range(k), key=lambda j: (-(quotas[j] - counts[j]), j))
    i = 0
    while sum(counts) < layers:
        counts[order[i % k]] += 1
        i += 1
    out, start = [], 0
    for c in counts:
        out.append((start, start + c))
        start += c
    return out


def split_with_tail(layers: int, weights: Sequence[float], tail_start: int
                    ) -> list[tuple[int, int]] | None:
    """Like split_layers, but the last member starts at or before ``tail_start`` (when it is
    > 0): the tail [tail_start, layers) stays whole on the deciding stage. None when the
    layers before it cannot give every other member one."""
    plain = split_layers(layers, weights)
    if tail_start <= 0 or plain[-1][0] <= tail_start:
        return plain
    if len(weights) - 1 > tail_start:
        return None
    head = split_layers(tail_start, weights[:-1])
    return head + [(tail_start, layers)]


def tail_start_of(config: Mapping[str, WireValue]) -> int:
    """The `tail_start` of a model from its config.json (text config merged in): for Gemma 4
    (gemma4_text), the first of the last cache-owning full-attention and sliding-window layers:
    the KV-shared layers after them read them within a call, and the assistant drafter reads
    their caches, so they and everything after stay on the last stage. 0 for other families."""
    named = config.get("layer_types")
    types = list(named) if isinstance(named, list) else []
    if config.get("model_type") not in ("gemma4_text", "gemma4") or not types:
        return 0
    owners = len(types) - as_int(config.get("num_kv_shared_layers") or 0)
    last = {t: i for i, t in enumerate(types[:owners])}
    return min(last.values()) if last else 0


def member_need(spec: ModelSpec, n_layers: int, dtype: str = "bfloat16",
                overhead: float = OVERHEAD) -> int:
    scale = DTYPE_SCALE.get(dtype, 1.0)
    weights = spec.size_bytes * n_layers / spec.layers * overhead
    return math.ceil((weights + n_layers * spec.kv_bytes_per_layer()) * scale)


def tensor_need(spec: ModelSpec, members: int, dtype: str = "bfloat16",
                overhead: float = OVERHEAD) -> int:
    """A member of a tensor-parallel group of `members`: 1/N of every layer's weights and
    of the KV cache (the member that runs the loop also holds the embedding and head once;
    they are inside size_bytes, split evenly here)."""
    scale = DTYPE_SCALE.get(dtype, 1.0)
    weights = spec.size_bytes * overhead / members
    kv = spec.layers * spec.kv_bytes_per_layer() / members
    return math.ceil((weights + kv) * scale)


def _try_tensor(spec: ModelSpec, group: Sequence[str], free: Mapping[str, int],
                dtypes: Mapping[str, str], overhead: float) -> Placement | None:
    if len(group) < 2 or (spec.kv_heads and len(group) > spec.kv_heads):
        return None
    needs = tuple(tensor_need(spec, len(group), dtypes.get(n, "bfloat16"), overhead)
                  for n in group)
    if any(need > free[n] for n, need in zip(group, needs, strict=True)):
        return None
    return Placement(spec.id, tuple(group), tuple((0, spec.layers) for _ in group), needs, spec,
                     parallel="tensor")


def _ring_order(names: Iterable[str], free: Mapping[str, int], tail: bool = False) -> list[str]:
    order = sorted(names, key=lambda n: (-free[n], n))
    # A model with a pinned tail: the member with the most room holds it, last.
    return order[1:] + order[:1] if tail else order


def _try_ring(spec: ModelSpec, ring: Sequence[str], free: Mapping[str, int],
              dtypes: Mapping[str, str], overhead: float) -> Placement | None:
    if len(ring) > spec.layers or any(free[n] <= 0 for n in ring):
        return None
    ranges = split_with_tail(spec.layers, [free[n] for n in ring], spec.tail_start)
    if ranges is None:
        return None
    needs = tuple(member_need(spec, b - a, dtypes.get(n, "bfloat16"), overhead)
                  for n, (a, b) in zip(ring, ranges, strict=True))
    if any(need > free[n] for n, need in zip(ring, needs, strict=True)):
        return None
    return Placement(spec.id, tuple(ring), tuple(ranges), needs, spec)


def _fmt(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def place_model(spec: ModelSpec, nodes: Sequence[NodeOffer], free: Mapping[str, int] | None = None,
                ring: Sequence[str] = (), overhead: float = OVERHEAD) -> Placement:
    """The placement of one model over ``nodes`` with ``free`` bytes left on each (default:
    all they offer). ``ring`` forces those nodes in that order. Raises PlacementError."""
    if spec.engine:
        # A served card runs in one llama-server on one node that has the engine: no rings.
        able = [n for n in nodes if spec.engine in n.engines]
        if not able:
            raise PlacementError(spec.id, f"model {spec.id} needs engine {spec.engine}, which "
                                          "no alive node offers (install skulkp2p[served] or "
                                          "set SKULKP2P_LLAMA_SERVER_BIN there)")
        if len(ring) > 1:
            raise PlacementError(spec.id, f"model {spec.id} runs on engine {spec.engine}: "
                                          "single-node only, name one node")
        lacking = [r for r in ring if r in {n.name for n in nodes} - {n.name for n in able}]
        if lacking:
            raise PlacementError(spec.id, f"model {spec.id}: node {lacking[0]} does not offer "
                                          f"engine {spec.engine}")
        nodes = able
    if spec.tensor and spec.engine:
        raise PlacementError(spec.id, f"model {spec.id} runs on engine {spec.engine}: it cannot "
                                      "be placed tensor-parallel")
    if spec.tensor and ring and len(ring) < 2:
        raise PlacementError(spec.id, f"model {spec.id}: a tensor-parallel placement needs at "
                                      "least 2 nodes")
    if spec.tensor and ring and spec.kv_heads and len(ring) > spec.kv_heads:
        raise PlacementError(spec.id, f"model {spec.id} has {spec.kv_heads} KV heads: a "
                                      f"tensor-parallel group has at most {spec.kv_heads} members")
    attempt = _try_tensor if spec.tensor else _try_ring
    offers = {n.name: n for n in nodes}
    free = {n.name: n.memory for n in nodes} if free is None else dict(free)
    dtypes = {n.name: n.dtype for n in nodes}
    if ring:
        unknown = [n for n in ring if n not in offers]
        if unknown:
            raise PlacementError(spec.id, f"model {spec.id}: cannot place on "
                                          f"{', '.join(unknown)}: not alive members of the "
                                          f"cluster (alive: {', '.join(sorted(offers)) or 'none'})")
        if len(set(ring)) != len(ring):
            raise PlacementError(spec.id, f"model {spec.id}: a node appears twice in the ring")
        if spec.tail_start and not spec.tensor and len(ring) - 1 > spec.tail_start:
            raise PlacementError(spec.id, f"model {spec.id} keeps layers [{spec.tail_start}, "
                                          f"{spec.layers}) together on its last stage: a ring "
                                          f"of at most {spec.tail_start + 1} nodes, got "
                                          f"{len(ring)}")
        got = attempt(spec, ring, free, dtypes, overhead)
        if got is None:
            raise _no_fit(spec, [offers[n] for n in ring], free, overhead, named=True)
        return dataclasses.replace(got, explicit=True)
    names = sorted((n for n in offers if free.get(n, 0) > 0), key=lambda n: (-free[n], n))
    smallest = 2 if spec.tensor else 1
    largest = (min(len(names), spec.kv_heads or len(names)) if spec.tensor
               else 1 if spec.engine else min(len(names), spec.layers))
    for size in range(smallest, largest + 1):
        if math.comb(len(names), size) <= MAX_COMBINATIONS:
            combos: Iterable[tuple[str, ...]] = itertools.combinations(names, size)
        else:  # many nodes: the largest ones, then each single swap of the smallest
            top = names[:size]
            combos = [tuple(top)] + [tuple(top[:-1] + [n]) for n in names[size:]]
        best: tuple[tuple[int, int, tuple[str, ...]], Placement] | None = None
        for combo in combos:
            order = _ring_order(combo, free, spec.tail_start > 0 and not spec.tensor)
            got = attempt(spec, order, free, dtypes, overhead)
            if got is None:
                continue
            headroom = min(free[n] - need for n, need in zip(order, got.needs, strict=True))
            key = (-sum(free[n] for n in order), -headroom, tuple(order))
            if best is None or key < best[0]:
                best = (key, got)
        if best is not None:
            return best[1]
    if spec.tensor and len(offers) < 2:
        raise PlacementError(spec.id, f"model {spec.id} asks for a tensor-parallel placement, "
                                      "which needs at least 2 nodes; the cluster has "
                                      f"{len(offers)}")
    raise _no_fit(spec, [offers[n] for n in offers], free, overhead, named=False)


def _no_fit(spec: ModelSpec, nodes: Sequence[NodeOffer], free: Mapping[str, int],
            overhead: float, named: bool) -> PlacementError:
    need_bf16 = member_need(spec, spec.layers, "bfloat16", overhead)
    dtypes = sorted({n.dtype for n in nodes})
    need = max((member_need(spec, spec.layers, d, overhead) for d in dtypes), default=need_bf16)
    total = sum(max(0, free.get(n.name, 0)) for n in nodes)
    kv = spec.kv_bytes_per_layer() * spec.layers
    where = "the named nodes offer" if named else "the cluster has"
    largest = max(nodes, key=lambda n: free.get(n.name, 0), default=None)
    biggest = (f"; largest free: {largest.name} {_fmt(free.get(largest.name, 0))}"
               if largest else "")
    dtype_note = f" in {'/'.join(dtypes)}" if dtypes and dtypes != ["bfloat16"] else ""
    return PlacementError(
        spec.id,
        f"model {spec.id} does not fit: it needs {_fmt(need)}{dtype_note} (weights "
        f"{_fmt(spec.size_bytes)} x {overhead:g} overhead + KV cache {_fmt(kv)} for "
        f"{spec.context_length} tokens), {where} {_fmt(total)} free over {len(nodes)} "
        f"node{'s' if len(nodes) != 1 else ''}{biggest}",
        needs=need, available=total)


def plan(requests: Sequence[Request], nodes: Sequence[NodeOffer],
         previous: Mapping[str, Placement] | None = None,
         eligible: Iterable[str] | None = None,
         overhead: float = OVERHEAD) -> dict[str, Placement | PlacementError]:
    """Placements for every request over ``nodes`` (every member that may hold a placement).

    A previous placement is kept, and its memory reserved, while all its ring members are still
    among ``nodes`` and its request did not change: a suspect member keeps its share until it is
    declared dead. New placements go only to ``eligible`` nodes (default: all), by model id.
    """
    previous = previous or {}
    offers = {n.name: n for n in nodes}
    allowed = set(offers) if eligible is None else set(eligible) & set(offers)
    free = {n.name: n.memory for n in nodes}
    out: dict[str, Placement | PlacementError] = {}
    by_id = {r.spec.id: r for r in requests}
    for model in sorted(by_id):
        old, req = previous.get(model), by_id[model]
        kept = old.surviving(lambda n: n not in offers) if old is not None else None
        if kept is None or kept.spec is None:
            continue
        same = [s for s in req.specs() if s.one_copy == kept.spec.one_copy]
        if (same and (not req.nodes or tuple(req.nodes) == kept.ring)
                and (not req.only or set(kept.holders) <= set(req.only))):
            extra = kept.replicas[:max(0, _wanted(req.spec) - 1)]
            kept = dataclasses.replace(kept, spec=same[0], replicas=extra)
            out[model] = kept
            for copy in kept.copies():
                for n, need in zip(copy.ring, copy.needs, strict=False):
                    free[n] -= need
    for model in sorted(by_id):
        if model in out:
            continue
        req = by_id[model]
        candidates = [offers[n] for n in sorted(allowed) if not req.only or n in req.only]
        first: PlacementError | None = None
        for spec in req.specs():
            try:
                got = place_model(spec, candidates, free, ring=req.nodes, overhead=overhead)
            except PlacementError as e:
                first = first or e
                continue
            out[model] = got
            for n, need in zip(got.ring, got.needs, strict=True):
                free[n] -= need
            break
        else:
            assert first is not None
            out[model] = first
    for model in sorted(by_id):  # every model's first replica is in: now the extra ones
        got_p, req = out[model], by_id[model]
        if isinstance(got_p, Placement):
            out[model] = _add_replicas(got_p, req, offers, allowed, free, overhead)
    for model, req in by_id.items():
        got_p = out[model]
        if req.pinned and isinstance(got_p, Placement):
            out[model] = _noted(got_p, req, offers, allowed)
    return out


def _wanted(spec: ModelSpec) -> int:
    """How many replicas a spec asks for (AUTO_REPLICAS: as many as there may be)."""
    return MAX_REPLICAS if spec.replicas == AUTO_REPLICAS else max(1, spec.replicas)


def _add_replicas(p: Placement, req: Request, offers: Mapping[str, NodeOffer],
                  allowed: set[str], free: dict[str, int], overhead: float) -> Placement:
    """``p`` with replicas added, on nodes no replica of it uses, until it has as many as
    asked (AUTO_REPLICAS: one alone on each asking node that fits it) or nothing more fits."""
    spec = p.spec if p.spec is not None else req.spec
    copy_spec = spec.one_copy  # a tensor group placed as a ring meanwhile: copies as rings
    if spec.tensor and p.parallel != "tensor":
        copy_spec = dataclasses.replace(copy_spec, parallel="pipeline")
    wanted = _wanted(spec)
    extra = list(p.replicas)
    used = set(p.holders)
    auto = spec.replicas == AUTO_REPLICAS
    places = ([(n,) for n in req.askers] if auto else [()] * (wanted - 1 - len(extra)))
    for ring in places:
        if len(extra) + 1 >= wanted:
            break
        if any(n in used or n not in allowed for n in ring):
            continue
        candidates = [offers[n] for n in sorted(allowed - used)
                      if not req.only or n in req.only]
        if not candidates:
            break
        try:
            got = place_model(copy_spec, candidates, free, ring=ring, overhead=overhead)
        except PlacementError:
            if auto:
                continue
            break
        extra.append(dataclasses.replace(got, spec=None, explicit=False))
        used |= set(got.ring)
        for n, need in zip(got.ring, got.needs, strict=True):
            free[n] -= need
    return dataclasses.replace(p, replicas=tuple(extra)) if extra != list(p.replicas) else p


def _noted(p: Placement, req: Request, offers: Iterable[str], alive: set[str]) -> Placement:
    """A placement of a request pinned to nodes some of which are away: it says so, naming
    the ones that are gone (else the ones not alive), so a passing suspicion of another
    member does not change it."""
    if p.ring == req.pinned:  # still where it was pinned (a member suspect, not dead yet)
        return dataclasses.replace(p, pinned=(), note="")
    away = ([n for n in req.pinned if n not in offers]
            or [n for n in req.pinned if n not in alive])
    were = "is" if len(away) == 1 else "are"
    how = (" as a pipeline ring (a tensor-parallel group does not fit the nodes alive)"
           if req.spec.tensor and p.parallel != "tensor" else "")
    note = (f"model {req.spec.id} is pinned to {', '.join(req.pinned)}, but "
            f"{', '.join(away) or 'not all of them'} {were} not alive: placed automatically "
            f"on {', '.join(p.ring)}{how} until {'it is' if len(away) == 1 else 'they are'} "
            "back")
    return dataclasses.replace(p, pinned=req.pinned, note=note)

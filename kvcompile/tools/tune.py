"""`kvcompile tune`: the compiler chooses the policy at a KV budget.

Every mix of registered parts is a valid policy, so the best policy for a model and a budget can be searched
for instead of hand-picked. The search space is the part library itself: for each searched family (scoring,
the layer and head allocation, the schedule, the storage precision, the merge rule) the registered parts,
each at the fields of the first shipped spec that uses it (else its declared defaults), plus optional grids
of field values, each value checked against the field's declared range. A candidate is one spec mapping;
the spec validator and the plan decide whether it exists (a refused candidate is skipped with its reason
counted and never evaluated).

Evaluation is cheap because a prompt's forward pass does not depend on a prefill-time policy: each
calibration sample is prefilled once (`sweep.capture`, nothing evicted) and every candidate is replayed over
the captured layers (`sweep.replay`). A candidate is scored first by a proxy of the next-token distributions
along the gold answer, teacher-forced after the compressed context (query-agnostic mode: after the question is
fed through it, as a question after a compressed context is): FullCacheKL, minus their KL from the full
cache's (default), or GoldLikelihood, the gold tokens' mean log-probability; then the best few are confirmed by
greedy generation and the task's own score. Only the samples the full cache answers calibrate (on the others
every policy fails alike). Which candidates get how many samples is successive halving (Jamieson and
Talwalkar, 2016): every candidate on a few samples of different tasks (calibration_order), the best 1/eta on
eta times as many, until the survivors have every sample, where they are confirmed. Halving rather than a
model-based search (Optuna's TPE) because the space is categorical and small, a candidate's cost is nearly the
same for all, and halving's result is a plain function of the seed (the samples' order), with no surrogate to
explain.

Budgets are equal in bytes where precision is searched: at `kv_bytes` = F (a fraction of the full cache's
key and value bytes), a candidate keeps per_head_for_bytes(F) entries per KV head, so an int4 candidate keeps
about four times the entries of a full-precision one in the same bytes. At `kv_fraction` = f every candidate
keeps floor(f * n) entries per head and the storage stays the model's dtype.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import pickle
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

SEARCHED = ("scoring", "layers", "heads", "schedule", "storage", "merge")
SCHEDULES = ("prefill", "cascade")  # the schedule forms a one-pass prefill can be replayed into


class SpaceError(ValueError):
    """A search space that names an unknown family, part or field, or a value outside a field's range."""


@dataclass(frozen=True)
class Space:
    """What the search tries. `parts`: family -> the part names tried (schedule: "prefill" | "cascade").
    `fields`: "family.part.field" -> the values tried for that field wherever the part is chosen. `ranking`:
    the ranking section every candidate shares."""

    parts: dict[str, tuple[str, ...]]
    fields: dict[str, tuple] = field(default_factory=dict)
    ranking: dict = field(default_factory=lambda: {"by_score": {"sinks": 0, "window": 32}})

    def describe(self) -> list[str]:
        lines = [f"{family}: {', '.join(names)}" for family, names in self.parts.items()]
        lines += [f"{path}: {', '.join(map(str, values))}" for path, values in self.fields.items()]
        return lines + [f"ranking: {json.dumps(self.ranking)}"]


def _registry():
    from kvcompile.policies import PARTS
    return PARTS


def seeded_fields() -> dict[tuple[str, str], dict]:
    """(family, part) -> the fields of the first shipped spec (alphabetical) that uses the part, for the parts
    that have required fields or whose shipped settings differ from their defaults (window_attention's pooling)."""
    from kvcompile.spec import available_specs, load_spec, policy_to_mapping

    found: dict[tuple[str, str], dict] = {}
    for name in available_specs():
        mapping = policy_to_mapping(load_spec(name))
        sections = {"scoring": mapping.get("scoring"), "storage": mapping.get("storage"), "merge": mapping.get("merge"),
                    "layers": mapping.get("budget", {}).get("layers"), "heads": mapping.get("budget", {}).get("heads")}
        for family, value in sections.items():
            if isinstance(value, dict):
                (name, fields), = value.items()
                found.setdefault((family, name), dict(fields or {}))
        split = mapping.get("budget", {}).get("split")
        if isinstance(mapping.get("merge"), dict) and split:  # the split a merge rule's residual slots come from
            found.setdefault(("split", next(iter(mapping["merge"]))), dict(split))
    return found


def default_space(bytes_budget: bool) -> Space:
    """Every registered part of each searched family at its seeded fields; storage only where the budget is in
    bytes (at an entry budget a lower precision only saves bytes, which the score does not see); merge `drop`
    only (a space may widen it: `candidates` gives a merge rule its split)."""
    parts = _registry()
    chosen = {"scoring": tuple(sorted(parts["scoring"])), "layers": tuple(sorted(parts["layers"])),
              "heads": tuple(sorted(parts["heads"])), "schedule": SCHEDULES,
              "storage": tuple(sorted(parts["storage"])) if bytes_budget else ("model_dtype",),
              "merge": ("drop",)}
    return Space(chosen)


def load_space(source, bytes_budget: bool) -> Space:
    """A Space from a YAML file or a mapping: `{scoring: [lava, window_attention], storage: [int4],
    fields: {ranking.by_score.window: [0, 32]}}`; a family left out keeps the default space's parts."""
    import yaml

    data = source if isinstance(source, dict) else yaml.safe_load(Path(source).read_text())
    where = "the search space" if isinstance(source, dict) else str(source)
    if not isinstance(data, dict):
        raise SpaceError(f"{where}: a mapping of families to part lists (and `fields`, `ranking`) is expected")
    default = default_space(bytes_budget)
    parts = dict(default.parts)
    registry = _registry()
    for family, names in data.items():
        if family in ("fields", "ranking"):
            continue
        if family not in SEARCHED:
            raise SpaceError(f"{where}: unknown family {family!r}; searched families: {', '.join(SEARCHED)}")
        names = [names] if isinstance(names, str) else names
        if not isinstance(names, list) or not names:
            raise SpaceError(f"{where}: {family} must be a part name or a non-empty list of part names")
        known = SCHEDULES if family == "schedule" else tuple(registry[family])
        for name in names:
            if name not in known:
                raise SpaceError(f"{where}: {family}: unknown part {name!r}; registered: {', '.join(sorted(known))}")
        parts[family] = tuple(names)
    fields = {}
    for path, values in (data.get("fields") or {}).items():
        fields[path] = tuple(_checked_values(where, path, values, registry))
    ranking = data.get("ranking", default.ranking)
    return Space(parts, fields, ranking)


def _checked_values(where: str, path: str, values, registry) -> list:
    from kvcompile.policies.fields import check_ranges

    bits = path.split(".")
    if len(bits) != 3 or bits[0] not in registry or bits[1] not in registry[bits[0]]:
        raise SpaceError(f"{where}: fields: {path!r} is not family.part.field of a registered part")
    cls = registry[bits[0]][bits[1]]
    names = {f.name: f for f in dataclasses.fields(cls)}
    if bits[2] not in names:
        raise SpaceError(f"{where}: fields: {path}: {bits[1]} has no field {bits[2]!r}; its fields: "
                         f"{', '.join(names) or 'none'}")
    if not isinstance(values, list) or not values:
        raise SpaceError(f"{where}: fields: {path} must be a non-empty list of values")
    probe = object.__new__(cls)  # check_ranges reads the fields it is given: check one field at a time
    for value in values:
        object.__setattr__(probe, bits[2], value)
        for other in names:
            if other != bits[2]:
                object.__setattr__(probe, other, _valid_default(names[other]))
        try:
            check_ranges(probe)
        except ValueError as exc:
            raise SpaceError(f"{where}: fields: {path}: {exc}") from None
    return values


def _valid_default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


@dataclass(frozen=True)
class Candidate:
    key: str  # a stable name: the chosen parts and field values
    mapping: dict  # a spec mapping without its budget total (set per sample: per_head)
    same: tuple[str, ...] = ()  # the keys of the space's other points that are this policy (Policy.acting)


def _part_value(family: str, name: str, seeded: dict, grid: dict[str, tuple]):
    """The part's spec value(s): one per combination of its grid fields."""
    base = dict(seeded.get((family, name), {}))
    axes = [(path.split(".")[2], values) for path, values in grid.items() if path.split(".")[:2] == [family, name]]
    if not axes:
        return [name if not base else {name: base}]
    out = []
    for combo in itertools.product(*(values for _, values in axes)):
        fields = dict(base, **{f: v for (f, _), v in zip(axes, combo)})
        out.append({name: fields})
    return out


def candidates(space: Space) -> tuple[list[Candidate], Counter]:
    """Every candidate of the space that the spec validator accepts (at a nominal budget of 64 per head; the
    real budget is set per sample), and the refused ones counted by reason. Points of the space that compute the
    same policy (Policy.acting: a schedule's cascade beside a layers rule that cascades anyway) are one
    candidate, the first in the space's order, which names the others in `same`. A layers part that ranks every
    head's entries together (`ranks_entries`: layers: global) admits one heads value, its `sole_heads` part at
    its defaults: where the space's heads include that part, the layers part is paired with it once and with
    no other heads value (the heads grid and seeded fields are the other layers parts' business)."""
    from kvcompile.spec import SpecError, load_spec
    from kvcompile.tools.sweep import not_replayable

    seeded = seeded_fields()
    grid = dict(space.fields)
    ranking_grid = {path: values for path, values in grid.items() if path.startswith("ranking.")}
    options = {family: [v for name in space.parts[family] for v in
                        ([name] if family == "schedule" else _part_value(family, name, seeded, grid))]
               for family in SEARCHED}
    rankings = [space.ranking]
    if ranking_grid:
        (rname, rfields), = space.ranking.items()
        axes = [(p.split(".")[2], v) for p, v in ranking_grid.items() if p.split(".")[1] == rname]
        rankings = [{rname: dict(rfields, **dict(zip([a for a, _ in axes], combo)))}
                    for combo in itertools.product(*(v for _, v in axes))]
    kept, refused, seen, acting = [], Counter(), set(), {}
    for combo in itertools.product(*(options[f] for f in SEARCHED), rankings):
        choice = dict(zip(SEARCHED + ("ranking",), combo))
        choice["heads"] = _admitted_heads(choice["layers"], choice["heads"], space)
        budget = {"per_head": 64, "layers": choice["layers"], "heads": choice["heads"]}
        split = seeded.get(("split", _part_name(choice["merge"])))
        if split is not None:  # a merge rule's slots: the split of the first shipped spec with the rule (ZSMerge's
            budget["split"] = split  # Eq. 3 parts), whose proximity part is the recent window: the ranking's is 0
            choice["ranking"] = {name: dict(fields, window=0) for name, fields in choice["ranking"].items()}
        mapping = {"name": "tuned", "scoring": choice["scoring"], "ranking": choice["ranking"], "budget": budget,
                   "merge": choice["merge"], "schedule": choice["schedule"], "storage": choice["storage"]}
        key = _key(choice)
        if key in seen:
            continue
        seen.add(key)
        try:
            policy = load_spec(mapping)
        except SpecError as exc:
            refused[_reason(str(exc))] += 1
            continue
        why = not_replayable(policy)
        if why is not None:
            refused[f"not replayable from one captured prefill: {why.split(':')[0]}"] += 1
            continue
        first = acting.setdefault(policy.acting(), len(kept))
        if first < len(kept):
            kept[first] = dataclasses.replace(kept[first], same=kept[first].same + (key,))
            continue
        kept.append(Candidate(key, mapping))
    return kept, refused


def _admitted_heads(layers, heads, space: Space):
    """The heads value paired with the layers value: the layers part's sole heads part (at its defaults) where it
    ranks every head's entries together and the space tries that part, else `heads` as the space gives it."""
    rule = _registry()["layers"][layers if isinstance(layers, str) else next(iter(layers))]
    sole = rule.sole_heads if rule.ranks_entries else None
    return sole if sole is not None and sole in space.parts["heads"] else heads


def _part_name(value) -> str:
    """A part's name from its spec value (`drop`, or `{residual: {alpha: 0.6}}`)."""
    return value if isinstance(value, str) else next(iter(value))


def _key(choice: dict) -> str:
    def short(value):
        if isinstance(value, str):
            return value
        (name, fields), = value.items()
        return name + ("(" + ",".join(f"{k}={_flat(v)}" for k, v in sorted(fields.items())) + ")" if fields else "")
    return " | ".join(f"{family}={short(choice[family])}" for family in SEARCHED + ("ranking",))


def _flat(value) -> str:
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_flat(v)}" for k, v in sorted(value.items())) + "}"
    return str(value)


def _reason(message: str) -> str:
    """A refusal's reason without the file and values that vary between candidates."""
    text = message.split(": ", 1)[-1]
    return text.split(" (")[0][:160]


# ------------------------------------------------------------------------------------------ evaluation

@dataclass
class Sample:
    """One calibration sample as token ids: the part compressed, the part fed after it (the question in
    query-agnostic mode; empty in query-aware mode, where the question is part of `context`), the gold answer's
    tokens, and what the task's score needs (task, answers)."""

    index: int
    context: list[int]
    question: list[int]
    gold: list[int]
    task: str = ""
    answers: list[str] = field(default_factory=list)


def samples_from_ruler(tokenizer, rows: list[dict], mode: str) -> list[Sample]:
    """Samples (kvcompile.tools.ruler's rows or a dataset in kvpress's columns) as token ids in `mode`."""
    from kvcompile.tools.ruler import mode_prompt

    out = []
    for row in rows:
        context, question = mode_prompt(tokenizer, row, mode)
        gold = tokenizer.encode(" " + ", ".join(row["answers"]), add_special_tokens=False)
        out.append(Sample(row["index"], context, question, gold, row["task"], list(row["answers"])))
    return out


@dataclass
class Budget:
    """kv_fraction: a share of the entries per head; kv_bytes: a share of the full cache's key and value bytes."""

    kv_fraction: float | None = None
    kv_bytes: float | None = None

    def __post_init__(self):
        if (self.kv_fraction is None) == (self.kv_bytes is None):
            raise ValueError("tune: give exactly one of kv_fraction and kv_bytes")
        value = self.kv_fraction if self.kv_bytes is None else self.kv_bytes
        if not (isinstance(value, (int, float)) and 0 < value < 1):
            raise ValueError(f"tune: the budget must be a number in (0, 1), got {value!r}")

    def label(self) -> str:
        return f"kv_fraction {self.kv_fraction:g}" if self.kv_bytes is None else f"kv_bytes {self.kv_bytes:g}"

    def policy(self, mapping: dict, n: int, model):
        """The candidate's Policy for a compressed part of n tokens."""
        from kvcompile.tools.models import model_summary
        from kvcompile.tools.ruler import per_head_for_bytes
        from kvcompile.spec import load_spec

        base = load_spec(mapping)
        if self.kv_bytes is None:
            return load_spec(base, per_head=max(1, math.floor(self.kv_fraction * n + 1e-9)))
        geometry = (model_summary(model)["head_dim"], next(model.parameters()).element_size())
        return load_spec(base, per_head=per_head_for_bytes(base, n, self.kv_bytes, *geometry))


@dataclass(frozen=True)
class GoldLikelihood:
    """The proxy as the mean log-probability of the gold answer's tokens, teacher-forced after the compressed
    context: log p(gold_t | context, question, gold_<t), averaged over t."""

    name = "logp"  # kvcompile tune --proxy
    reference = False  # reads no full-cache distribution
    label = "the mean log p of the gold answer after the compressed context"

    def __call__(self, logp: torch.Tensor, gold: torch.Tensor, full: torch.Tensor | None) -> float:
        return float(logp.gather(-1, gold[:, None]).mean())


@dataclass(frozen=True)
class FullCacheKL:
    """The proxy as minus the mean KL divergence of the compressed cache's next-token distribution from the full
    cache's, along the gold answer (teacher-forced, so both read the same prefixes): -mean_t KL(p_full(. | gold_<t)
    || p(. | gold_<t)); 0 is the full cache's own. It measures how much of the full cache's answer a policy
    keeps, where a sample's gold log-likelihood also measures what the model would get wrong with every entry
    (a long list answer the model cannot produce moves the mean log-likelihood by more than a retrieved needle)."""

    name = "kl"  # kvcompile tune --proxy
    reference = True  # reads the full cache's distribution, computed once per sample (Evaluator.reference)
    label = "minus the mean KL from the full cache's next-token distributions along the gold answer"

    def __call__(self, logp: torch.Tensor, gold: torch.Tensor, full: torch.Tensor | None) -> float:
        return -float((full.exp() * (full - logp)).sum(-1).mean())


PROXIES = {measure.name: measure for measure in (FullCacheKL, GoldLikelihood)}  # kvcompile tune --proxy


class Evaluator:
    """The proxy and the confirmation of candidates on samples, one captured prefill per sample. Every scorer's
    scores (a reconstruction scorer's, kvzip's, included: sweep.reconstruction_scores) are computed once per
    sample and scorer configuration and kept for the whole search (sweep.replay), so a candidate costs its
    selection and the proxy's forwards. tokenizer /
    repeat_prompt: compile()'s, for kvzip's repeat prompt (default: the tokenizer saved with the model)."""

    def __init__(self, model, samples: list[Sample], budget: Budget, max_new_tokens: int = 32, decode=None,
                 tokenizer=None, repeat_prompt=None, proxy=None):
        self.model, self.samples, self.budget, self.max_new_tokens = model, samples, budget, max_new_tokens
        self.decode = decode  # token ids -> text, for the confirmation's task score
        self.tokenizer, self.repeat_prompt = tokenizer, repeat_prompt
        self.measure = FullCacheKL() if proxy is None else proxy  # the proxy: FullCacheKL or GoldLikelihood
        self._states: dict[int, tuple] = {}
        self._scores: dict[int, dict] = {}  # sample -> its scores by scorer (Captured.scores), kept throughout
        self._references: dict[int, torch.Tensor] = {}  # sample -> the full cache's log-probs along the gold

    def _captured(self, i: int):
        from kvcompile.tools.sweep import capture

        if i not in self._states:
            self._states.clear()  # one sample's layers at a time (every query, key and value of a long prompt)
            ids = torch.tensor([self.samples[i].context])
            states, logits = capture(self.model, ids)
            states.scores = self._scores.setdefault(i, {})
            self._states[i] = states, logits
        return self._states[i]

    def prepare(self, i: int) -> dict:
        """Capture sample i now, and its full-cache reference where the proxy reads one (before Workers fork, so
        every child reads them); its kept scores by scorer."""
        if self.measure.reference:
            self.reference(i)
        return self._captured(i)[0].scores

    @torch.no_grad()
    def reference(self, i: int) -> torch.Tensor:
        """The full cache's log-probabilities (T, V) along sample i's gold answer (teacher-forced), computed once
        and kept for the search (T·V floats a sample: 6 MiB for a 32-token answer over SmolLM2's vocabulary)."""
        if i not in self._references:
            s = self.samples[i]
            cache, logits = self._full_cache(i, len(s.question) + len(s.gold))
            self._references[i] = self._along_gold(cache, logits, s, {})
        return self._references[i]

    def _full_cache(self, i: int, headroom: int):
        """Sample i's captured prompt with every entry kept (its prompt scores not added to the search's)."""
        from kvcompile.spec import load_spec
        from kvcompile.tools.sweep import KEEP_ALL, Captured, replay

        states, logits = self._captured(i)
        every = Captured(list(states), states.windows, states.sinks, states.ids)
        policy = load_spec(KEEP_ALL, per_head=len(self.samples[i].context))
        return replay(policy, self.model.config, every, headroom=headroom), logits

    def _along_gold(self, cache, logits, s: Sample, options: dict) -> torch.Tensor:
        """Log-probabilities (T, V) of the gold answer's tokens, teacher-forced: the question and the gold answer
        but its last token fed in one forward (sweep.fed: the op decodes it token by token, every decode rule of
        the policy running, as generation would)."""
        from kvcompile.tools.sweep import fed

        ids = s.question + s.gold[:-1]
        if not ids:  # one gold token after the prompt: the prompt's last logits predict it
            return torch.log_softmax(logits.reshape(1, -1).float(), -1)
        rows = fed(self.model, cache, torch.tensor([ids]), **options)[0]
        rows = rows[len(s.question) - 1:] if s.question else torch.cat([logits.reshape(1, -1), rows])
        return torch.log_softmax(rows.float(), -1)

    def options(self, policy) -> dict:
        """compile()'s keywords for `policy`: a reconstruction scorer's repeat prompt (found once), else none."""
        if not getattr(policy.scoring, "reconstructs", False):
            return {}
        if self.repeat_prompt is None:
            from kvcompile.kvzip import repeat_prompt_for

            self.repeat_prompt = repeat_prompt_for(self.model, self.tokenizer)
        return {"repeat_prompt": self.repeat_prompt}

    def prescore(self, candidate: Candidate, i: int) -> bool:
        """Compute here sample i's prompt scores of `candidate`'s scorer where it reconstructs the prompt (kvzip:
        the model run again over the context, a sample's costliest scores, kept for every candidate with that
        scorer); True when it does. Workers call it before they fork, so this forward runs with every thread of
        the process rather than on one child's while the other child waits for the scores it needs. False (and
        nothing computed) for any other scorer, or a candidate the plan refuses (its own job reports why)."""
        from kvcompile.tools.sweep import reconstruction_scores

        try:
            policy = self.budget.policy(candidate.mapping, len(self.samples[i].context), self.model)
        except (ValueError, RuntimeError):
            return False
        if not getattr(policy.scoring, "reconstructs", False):
            return False
        reconstruction_scores(self.model, policy, self._captured(i)[0], **self.options(policy))
        return True

    def _cache(self, candidate: Candidate, i: int, headroom: int):
        from kvcompile.tools.sweep import replay

        states, logits = self._captured(i)
        policy = self.budget.policy(candidate.mapping, len(self.samples[i].context), self.model)
        cache = replay(policy, self.model.config, states, headroom=headroom, model=self.model, **self.options(policy))
        return cache, logits

    @torch.no_grad()
    def proxy(self, candidate: Candidate, i: int) -> float:
        """The proxy (`measure`) of the next-token distributions along the gold answer, teacher-forced after the
        compressed context (and the question)."""
        s = self.samples[i]
        full = self.reference(i) if self.measure.reference else None
        cache, logits = self._cache(candidate, i, len(s.question) + len(s.gold))
        logp = self._along_gold(cache, logits, s, self.options(cache.policy))
        return self.measure(logp, torch.tensor(s.gold), full)

    @torch.no_grad()
    def confirms(self, candidates: list, i: int) -> list[tuple]:
        """`confirm` of each candidate on sample i, their greedy answers decoded as one batch a step
        (sweep.greedy_together: the tokens each cache gives alone, but where two tokens nearly tie): per candidate
        (value, refusal, wall, CPU), a candidate whose plan refuses the model or budget with its reason (as
        `_timed`). (The proxies are computed one candidate at a time: a batched forward's logits differ from one
        cache's in the last bits, and a proxy is compared across candidates and runs to those bits; a greedy answer
        changes only at a near tie.)"""
        from kvcompile.tools.ruler import eos_ids
        from kvcompile.tools.sweep import greedy_together

        s = self.samples[i]
        out, caches, lasts, mine = self._prepared(candidates, i, len(s.question) + self.max_new_tokens)
        if caches:
            answers, seconds = greedy_together(self.model, caches, lasts, self.max_new_tokens, eos_ids(self.model),
                                               options_of=lambda cache: self.options(cache.policy))
            for k, tokens, (wall, cpu) in zip(mine, answers, seconds):
                _, _, own_wall, own_cpu = out[k]
                out[k] = (self._scored(tokens, s), None, own_wall + wall, own_cpu + cpu)
        return out

    def _prepared(self, candidates: list, i: int, headroom: int):
        """Each candidate's cache after sample i's question: (per candidate (None, refusal, wall, CPU) so far, the
        caches, their last logits, the candidates' places of the caches)."""
        s = self.samples[i]

        def prepared(candidate):
            cache, logits = self._cache(candidate, i, headroom)
            return cache, self._asked(cache, logits, s, self.options(cache.policy))

        out, caches, lasts, mine = [], [], [], []
        for k, candidate in enumerate(candidates):
            value, error, wall, cpu = _timed(lambda: prepared(candidate))
            if error is None:
                caches.append(value[0])
                lasts.append(value[1])
                mine.append(k)
            out.append((None, error, wall, cpu))
        return out, caches, lasts, mine

    @torch.no_grad()
    def full_score(self, i: int) -> float:
        """The task's score of the full cache's greedy answer on sample i (every entry kept)."""
        s = self.samples[i]
        cache, logits = self._full_cache(i, len(s.question) + self.max_new_tokens)
        return self._answer(cache, logits, s, {})

    @torch.no_grad()
    def confirm(self, candidate: Candidate, i: int) -> float:
        """The task's score of the greedy answer (100 where the decoded text holds every gold answer): one cache
        through `greedy`, the plain path `confirms` must equal (tests/test_tune.py), kept as its reference."""
        s = self.samples[i]
        cache, logits = self._cache(candidate, i, len(s.question) + self.max_new_tokens)
        return self._answer(cache, logits, s, self.options(cache.policy))

    def _asked(self, cache, logits, s: Sample, options: dict):
        """The last logits after sample s's question is fed to `cache` (the prompt's own where it has none)."""
        from kvcompile.tools.sweep import feed

        if not s.question:
            return logits
        return feed(self.model, cache, torch.tensor([s.question]), **options)

    def _answer(self, cache, logits, s: Sample, options: dict) -> float:
        from kvcompile.tools.ruler import eos_ids
        from kvcompile.tools.sweep import greedy

        logits = self._asked(cache, logits, s, options)
        tokens = greedy(self.model, cache, logits, self.max_new_tokens, eos_ids(self.model), **options)[0].tolist()
        return self._scored(tokens, s)

    def _scored(self, tokens: list[int], s: Sample) -> float:
        from kvcompile.tools.ruler import score

        if self.decode is None:  # token-level: the gold tokens appear in order at the start
            return 100.0 * float(tokens[:len(s.gold)] == s.gold)
        return 100.0 * score(s.task, self.decode(tokens), s.answers)  # RULER's share of gold strings, in %


# ------------------------------------------------------------------------------------------ search

@dataclass
class Trial:
    candidate: Candidate
    proxy: dict[int, float] = field(default_factory=dict)  # sample index -> proxy score
    confirmed: dict[int, float] = field(default_factory=dict)
    error: str | None = None

    def mean(self, what: str = "proxy") -> float:
        values = getattr(self, what)
        return sum(values.values()) / len(values) if values else -math.inf


@dataclass
class Result:
    best: Trial
    trials: list[Trial]
    refused: Counter
    rungs: list[tuple[int, int]]  # (candidates, samples each) per rung
    agreement: float | None  # share of confirmed pairs the proxy orders as the confirmation does
    seed: int
    budget: Budget
    space: Space
    geometry: tuple[int, int]  # (head dim, bytes per element) of the model tuned for
    cost: dict[str, Cost] = field(default_factory=dict)  # "proxy" / "confirm" -> what those evaluations cost
    proxy: str = GoldLikelihood.label  # what the proxy measured (its `label`)
    calibration: tuple[int, int] = (0, 0)  # (samples calibrated on, samples given): the full cache answers the first
    entered: tuple[str, ...] = ()  # the keys of the candidates entered beside the space (tune's `entered`)


@dataclass
class Cost:
    """What a search's evaluations cost: wall and process CPU seconds (all threads), summed over the evaluations
    that carry a time. A sample's captured prefill and its reconstruction scores are paid inside the first
    evaluation that needs them, so the sum is the search's whole compute but for loading the model and samples."""

    evaluations: int = 0
    timed: int = 0  # evaluations with a time (records written before times were kept have none)
    wall: float = 0.0
    cpu: float = 0.0

    def add(self, wall: float | None, cpu: float | None) -> None:
        self.evaluations += 1
        if wall is not None and cpu is not None:
            self.timed, self.wall, self.cpu = self.timed + 1, self.wall + wall, self.cpu + cpu

    def describe(self) -> str:
        untimed = self.evaluations - self.timed
        return (f"{self.evaluations} evaluations, {self.wall:,.0f} s wall, {self.cpu:,.0f} CPU-s"
                + (f" ({untimed} recorded without a time)" if untimed else ""))


class Records:
    """--resume: one JSON line per (candidate, sample, kind) evaluation, appended and flushed as it is made, with
    the evaluation's wall and CPU seconds; `cost(kind)` sums them over the evaluations this search used. A proxy's
    line names its measure (`proxy`: a PROXIES name; lines without one were written by GoldLikelihood, "logp"):
    a search reads the proxy lines of its own measure only, so a file resumed under another proxy never mixes
    the two (its lines are evaluated again and appended beside the others)."""

    def __init__(self, path=None, proxy: str = "logp"):
        self.path = None if path is None else Path(path)
        self.proxy = proxy
        self.seen: dict[tuple[str, int, str], float] = {}
        self.spent: dict[tuple[str, int, str], tuple[float | None, float | None]] = {}
        self.used: dict[tuple[str, int, str], None] = {}  # the evaluations this search read or made, each once
        if self.path is not None and self.path.exists():
            for line in self.path.read_text().splitlines():
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:  # a line cut by an interruption: evaluated again
                    continue
                if r["kind"] == "proxy" and r.get("proxy", "logp") != proxy:
                    continue
                key = (r["candidate"], r["sample"], r["kind"])
                self.seen[key], self.spent[key] = r["value"], (r.get("seconds"), r.get("cpu"))

    def find(self, trial: Trial, i: int, kind: str) -> float | None:
        """The recorded value (under the candidate's key or a point it stands for: Candidate.same), else None."""
        key = (trial.candidate.key, i, kind)
        for same in trial.candidate.same:
            if key not in self.seen and (same, i, kind) in self.seen:
                self.seen[key], self.spent[key] = self.seen[(same, i, kind)], self.spent[(same, i, kind)]
        if key not in self.seen:
            return None
        self.used[key] = None
        return self.seen[key]

    def put(self, trial: Trial, i: int, kind: str, value: float, wall: float, cpu: float) -> float:
        """Keep (and append to the file) an evaluation just made, with its wall and CPU seconds."""
        key = (trial.candidate.key, i, kind)
        self.seen[key], self.spent[key], self.used[key] = value, (wall, cpu), None
        if self.path is not None:
            with self.path.open("a") as f:
                f.write(json.dumps({"candidate": key[0], "sample": i, "kind": kind, "value": value,
                                    "seconds": round(wall, 3), "cpu": round(cpu, 3)}
                                   | ({"proxy": self.proxy} if kind == "proxy" else {})) + "\n")
        return value

    def get(self, trial: Trial, i: int, kind: str, compute) -> float:
        """The recorded value, else compute() kept (a refusal, ValueError or RuntimeError, propagates)."""
        value = self.find(trial, i, kind)
        if value is None:
            wall, cpu = time.perf_counter(), time.process_time()
            value = compute()
            value = self.put(trial, i, kind, value, time.perf_counter() - wall, time.process_time() - cpu)
        return value

    def cost(self, kind: str) -> Cost:
        total = Cost()
        for key in self.used:
            if key[2] == kind:
                total.add(*self.spent.get(key, (None, None)))
        return total


def successive_halving(trials: list[Trial], order: list[int], evaluate, eta: int = 3, first: int = 1,
                       confirm: int = 0, usable=None) -> list[tuple[int, int]]:
    """Every trial on the first `first` samples of `order`, then the best 1/eta (at least one, and at least
    `confirm` while more remain) on eta times as many, until a rung covers every sample: that last rung (or the
    one reached with `confirm` trials or fewer alive) takes every sample, and its trials, the finalists, are
    confirmed there too. `evaluate(i, trials, final)` fills trial.proxy[i] for the trials given (or sets
    trial.error) and, where `final`, trial.confirmed[i]: one sample's captured prefill serves every trial in turn
    (samples outside, trials inside). `usable(i)`, asked once per sample as the rungs reach it: False leaves the
    sample out (the rungs count the usable samples only). A trial whose proxies equal an earlier survivor's on
    every sample goes no further. Ties go to the earlier trial. Returns (trials,
    samples) per rung; `trials` is reordered: the finalists best first by proxy, then the rest."""
    verdicts: dict[int, bool] = {}

    def judged(i: int) -> bool:  # asked when a rung reaches the sample, before its evaluations
        if i not in verdicts:
            verdicts[i] = True if usable is None else bool(usable(i))
        return verdicts[i]

    alive, count, rungs, exhausted = list(trials), max(1, first), [], False
    while True:
        final = exhausted or count >= len(order) or len(alive) <= max(1, confirm)
        used = []
        for i in order:
            if not final and len(used) == count:
                break
            if not judged(i):
                continue
            used.append(i)
            todo = [t for t in alive if t.error is None and (i not in t.proxy or final and i not in t.confirmed)]
            if todo:
                evaluate(i, todo, final)
        if not used:
            raise ValueError("tune: no calibration sample is usable (the full cache answers none of them)")
        rungs.append((len(alive), len(used)))
        alive = [t for t in alive if t.error is None]
        alive.sort(key=lambda t: -t.mean())  # stable: ties keep the space's order
        if final:
            trials[:] = alive + [t for t in trials if t not in alive]
            return rungs
        exhausted = len(used) < count  # every usable sample seen: the next rung confirms
        # a trial whose proxies equal a better one's on every sample is that trial in effect (it kept the same
        # entries: two schedules of a static allocation, say): not carried further, so it takes no finalist's place
        seen, distinct = set(), []
        for t in alive:
            values = tuple(sorted(t.proxy.items()))
            if values not in seen:
                seen.add(values)
                distinct.append(t)
        alive = distinct[:max(1, math.ceil(len(distinct) / eta), min(confirm, len(distinct)))]
        count *= eta


@dataclass
class Workers:
    """Evaluations spread over `count` forked processes, one torch thread each (a one-token forward gains little
    from a second thread; a second process doubles the throughput of a two-core machine). Per sample, in the
    parent: the sample's prefill is captured (Evaluator.prepare) and a scorer's that reads the prompt again
    (kvzip's reconstruction, Evaluator.prescore) is computed with every thread of the process, not on one child
    while the other waits for those scores, so every child reads them without copying; then,
    first, one job per scorer whose prompt scores are not kept yet (each child computes the scores it needs and
    sends them back with the value, kept for the rest of the sample: Captured.scores), then the other jobs;
    children take jobs from one queue as they finish. Values are the same wherever a job runs. `count` 1: every
    job in this process, with its torch threads."""

    count: int = 1
    scored: set = field(default_factory=set)  # (sample, scorer) whose prompt scores a job has computed

    def run(self, evaluator, i: int, jobs: list[tuple], done) -> None:
        """jobs: (trial, kind, compute) with compute() -> value; done(job, value, error, wall, cpu) as each ends."""
        if not jobs:  # every evaluation recorded: nothing to capture
            return
        if self.count <= 1:
            for job in jobs:
                done(job, *_timed(job[2]))
            return
        prepare = getattr(evaluator, "prepare", None)
        kept = prepare(i) if prepare is not None else None  # the sample's captured prefill and its kept scores
        groups: dict = {}
        for job in jobs:
            groups.setdefault(_scorer_key(job[0].candidate), []).append(job)
        prescore = getattr(evaluator, "prescore", None)
        for key, group in groups.items():  # a reconstruction's scores: here, with every thread, before the fork
            if (i, key) not in self.scored and prescore is not None and prescore(group[0][0].candidate, i):
                self.scored.add((i, key))
        if len(jobs) == 1:  # not worth a fork; one thread, as in a child, so a value never depends on where it ran
            threads = torch.get_num_threads()
            torch.set_num_threads(1)
            try:
                done(jobs[0], *_timed(jobs[0][2]))
            finally:
                torch.set_num_threads(threads)
            return
        # a scorer's first job computes its scores while the others wait: its cheapest (a proxy, not a batch)
        firsts = [min(g, key=lambda job: isinstance(job[0], Together)) for key, g in groups.items()
                  if (i, key) not in self.scored]
        self.scored.update((i, key) for key in groups)
        rest = [job for job in jobs if all(job is not f for f in firsts)]
        for batch in (firsts, rest):
            if batch:
                self._forked(batch, kept, done)

    def _forked(self, jobs: list[tuple], kept, done) -> None:
        import multiprocessing as mp
        import queue as queues

        ctx = mp.get_context("fork")
        tasks, results = ctx.Queue(), ctx.Queue()
        for n in range(len(jobs)):
            tasks.put(n)
        children = [ctx.Process(target=_child, args=(jobs, tasks, results, kept), daemon=True)
                    for _ in range(min(self.count, len(jobs)))]
        for _ in children:
            tasks.put(None)
        for child in children:
            child.start()
        try:
            left = len(jobs)
            while left:
                try:
                    n, value, error, wall, cpu, scores = results.get(timeout=5)
                except queues.Empty:
                    if not any(c.is_alive() for c in children):
                        raise RuntimeError("tune: a worker process died before finishing its evaluations") from None
                    continue
                if n < 0:  # a child's own failure (not a plan's refusal): raised here, with its traceback
                    raise RuntimeError(f"tune: a worker failed:\n{error}")
                if scores and kept is not None:
                    for key, value_ in pickle.loads(scores).items():
                        kept.setdefault(key, value_)
                done(jobs[n], value, error, wall, cpu)
                left -= 1
        finally:
            for child in children:
                child.join(timeout=5)
                if child.is_alive():
                    child.kill()


def _child(jobs, tasks, results, kept) -> None:
    import traceback

    torch.set_num_threads(1)
    before = set(kept) if kept is not None else set()
    try:
        while (n := tasks.get()) is not None:
            value, error, wall, cpu = _timed(jobs[n][2])
            new = {k: v for k, v in kept.items() if k not in before} if kept is not None else {}
            before |= set(new)
            # plain pickle: the tensors' bytes travel in the message (torch's queue reductions would pass shared
            # memory that lives with this process)
            results.put((n, value, error, wall, cpu, pickle.dumps(new) if new else None))
    except BaseException:  # noqa: BLE001 - reported to the parent, which raises it
        results.put((-1, None, traceback.format_exc(), 0.0, 0.0, None))


@dataclass
class Together:
    """Trials of one sample confirmed as one job: their greedy answers decoded as one batch (Evaluator.confirms)."""

    trials: list

    @property
    def candidate(self) -> Candidate:  # the scorer of every trial of the batch (Workers: its scores first)
        return self.trials[0].candidate


class BatchFailure(Exception):
    """A batched evaluation failed as a whole (not a plan's refusal of one candidate, which is that candidate's
    result): the search stops with it."""


TOGETHER = 32  # the most trials a batched job takes (their compressed caches are held at once)


def _together(evaluator, i: int, jobs: list[tuple]) -> list[tuple]:
    """`jobs` with the confirmations batched where the evaluator batches them (Evaluator.confirms): per scorer (the
    scorer's prompt scores are computed once, by the first job), at most TOGETHER trials a job. The batches come
    first: the longest jobs, so that no worker is left with one at the end while the other waits (longest
    processing time first). (A batch is not split over the workers: a decode step reads the model's weights once
    for the whole batch, so halves cost about 1.5 times the CPU of the whole; measured on the default search.)"""
    if not isinstance(evaluator, Evaluator):  # an evaluator of its own (a test's): one job a trial
        return jobs
    groups: dict = {}
    rest = []
    for job in jobs:
        trial, kind, _ = job
        if kind == "confirm":
            groups.setdefault(_scorer_key(trial.candidate), []).append(trial)
        else:
            rest.append(job)
    out = []
    for trials in groups.values():
        for start in range(0, len(trials), TOGETHER):
            chunk = trials[start:start + TOGETHER]

            def compute(chunk=chunk):
                try:
                    return evaluator.confirms([t.candidate for t in chunk], i)
                except (ValueError, RuntimeError) as exc:  # not one candidate's refusal: the batch's own failure
                    raise BatchFailure(f"tune: a batched confirmation failed: {exc}") from exc

            out.append((Together(chunk), "confirm", compute))
    out.sort(key=lambda job: -len(job[0].trials))  # stable: a scorer's first batch stays its first job
    return out + rest


def _timed(compute):
    """(value, refusal, wall, cpu): a plan's refusal of the model or budget (ValueError, RuntimeError) is a
    result, the candidate never scored, not a failure of the search."""
    wall, cpu = time.perf_counter(), time.process_time()
    try:
        value, error = compute(), None
    except (ValueError, RuntimeError) as exc:
        value, error = None, _reason(str(exc))
    return value, error, time.perf_counter() - wall, time.process_time() - cpu


def _scorer_key(candidate: Candidate) -> str:
    return json.dumps(candidate.mapping.get("scoring"), sort_keys=True, default=str)


def _proxy_name(evaluator) -> str:
    return getattr(getattr(evaluator, "measure", None), "name", GoldLikelihood.name)


FULL_CACHE = "(the full cache)"  # the records' name for the full cache's own answers


def calibration_order(samples: list[Sample], seed: int) -> list[int]:
    """The order successive halving takes the samples in: each task's samples shuffled, the tasks shuffled, then
    one sample of each task in turn, so the first rungs see as many tasks as they have samples (a rung of one
    task's samples ranks candidates by what that task needs: a retrieval task and a word-frequency task prefer
    other scorers). A function of the seed."""
    rng = random.Random(seed)
    tasks: dict[str, list[int]] = {}
    for i, s in enumerate(samples):
        tasks.setdefault(s.task, []).append(i)
    groups = list(tasks.values())
    for group in groups:
        rng.shuffle(group)
    rng.shuffle(groups)
    return [group[k] for k in range(max(map(len, groups), default=0)) for group in groups if k < len(group)]


def tune(evaluator: Evaluator, space: Space, seed: int = 0, eta: int = 3, confirm: int = 3, records=None,
         progress: bool = True, workers: int = 1, answered_only: bool = True, first: int = 3,
         entered: list[Candidate] | tuple = ()) -> Result:
    """Search `space` for the best policy on the evaluator's samples (module doc); `workers` processes
    (Workers) evaluate each sample's candidates; `first`: the samples of the first rung, in calibration_order
    (several tasks: one sample's task decides too much). `answered_only`: calibrate on the samples the full
    cache answers (Evaluator.full_score > 0) only: on a sample every policy fails with every entry kept, the
    candidates' answers do not differ, and their proxies differ in what the answer does not need. `entered`:
    candidates searched beside the space's (Optuna's enqueued trials), such as kvpress's presses as reproduced
    (`press_candidates`), so that the search can answer that a press is the best it knows; one that is a
    candidate of the space as it acts (Policy.acting) is that candidate, named in its `same`."""
    from tqdm.auto import tqdm

    found, refused = candidates(space)
    if not found:
        raise SpaceError("tune: the space has no candidate the spec validator accepts; refused: "
                         + "; ".join(f"{n} × {why}" for why, n in refused.most_common()))
    found = _enter(found, entered)
    trials = [Trial(c) for c in found]
    order = calibration_order(evaluator.samples, seed)
    records = records if isinstance(records, Records) else Records(records, _proxy_name(evaluator))

    def planned(samples):  # the evaluations the search plans over this many samples: the bar's total
        proxies, finalists = _planned(len(trials), samples, eta, confirm, first)
        return proxies + finalists * samples

    bar = tqdm(total=planned(len(order)), desc="tune", unit="eval", disable=not progress)
    pool = Workers(workers)

    def evaluate(i, todo, final):
        jobs = []
        for trial in todo:
            for kind, held, compute in (("proxy", trial.proxy, evaluator.proxy),
                                        ("confirm", trial.confirmed, evaluator.confirm)):
                if kind == "confirm" and not final or i in held:
                    continue
                value = records.find(trial, i, kind)
                if value is not None:
                    held[i] = value
                    bar.update()
                else:
                    jobs.append((trial, kind, lambda c=compute, t=trial: c(t.candidate, i)))
        jobs = _together(evaluator, i, jobs)

        def done(job, value, error, wall, cpu):
            trial, kind, _ = job
            if isinstance(trial, Together):  # one value, refusal and seconds per trial of the batch
                for member, result in zip(trial.trials, value):
                    done((member, kind, None), *result)
                return
            bar.update()
            if error is not None:  # a plan that refuses this model or budget: never scored
                if trial.error is None:
                    trial.error = error
                    refused[error] += 1
                return
            (trial.proxy if kind == "proxy" else trial.confirmed)[i] = records.put(trial, i, kind, value, wall, cpu)

        pool.run(evaluator, i, jobs, done)

    full = Trial(Candidate(FULL_CACHE, {}))
    answers = getattr(evaluator, "full_score", None)

    left_out = []

    def usable(i):  # the full cache's own answer, recorded like any confirmation
        answered = records.get(full, i, "confirm", lambda: answers(i)) > 0
        if not answered:  # the plan shrinks with the samples left out: the bar's estimate of time left follows
            left_out.append(i)
            bar.total = max(bar.n, planned(len(order) - len(left_out)))
            bar.refresh()
        return answered

    rungs = successive_halving(trials, order, evaluate, eta, first, confirm=confirm,
                               usable=usable if answered_only and answers is not None else None)
    bar.close()
    finalists = [t for t in trials if t.error is None and t.confirmed]
    best = max(finalists, key=lambda t: (t.mean("confirmed"), t.mean()))  # max keeps the first on a tie
    from kvcompile.tools.models import model_summary

    geometry = (model_summary(evaluator.model)["head_dim"], next(evaluator.model.parameters()).element_size())
    cost = {kind: records.cost(kind) for kind in ("proxy", "confirm")}
    return Result(best, trials, refused, rungs, _agreement(finalists), seed, evaluator.budget, space, geometry, cost,
                  getattr(getattr(evaluator, "measure", None), "label", GoldLikelihood.label),
                  (rungs[-1][1], len(order)), tuple(c.key for c in entered))


def _enter(found: list[Candidate], entered) -> list[Candidate]:
    """The space's candidates and then each entered one that acts as none of them (Policy.acting); one that does
    is named in that candidate's `same`."""
    from kvcompile.spec import load_spec

    out = list(found)
    acting = {load_spec(c.mapping).acting(): i for i, c in enumerate(out)}
    for c in entered:
        i = acting.setdefault(load_spec(c.mapping).acting(), len(out))
        if i < len(out):
            out[i] = dataclasses.replace(out[i], same=out[i].same + (c.key,))
        else:
            out.append(c)
    return out


def press_candidates(evaluator: "Evaluator") -> list[Candidate]:
    """kvpress's presses as kvcompile reproduces them (reference_candidates' kvpress ones), at the evaluator's
    budget, as candidates to enter in a search."""
    return [c for kind, c in reference_candidates(evaluator)[0] if kind == "kvpress"]


def _planned(n: int, samples: int, eta: int, confirm: int = 0, first: int = 1) -> tuple[int, int]:
    """(proxy evaluations, finalists) of successive_halving: each rung's survivors on the samples they lack."""
    total, count, done = 0, max(1, first), 0
    while True:
        final = count >= samples or n <= max(1, confirm)
        count = samples if final else count
        total += n * (count - done)
        if final:
            return total, n
        n, done, count = max(1, math.ceil(n / eta), min(confirm, n)), count, count * eta


def _agreement(finalists: list[Trial]) -> float | None:
    """Among the confirmed candidates, the share of pairs whose proxy order is their confirmed order (pairs
    tied in either are left out); None with fewer than two such pairs."""
    pairs = agree = 0
    for a, b in itertools.combinations(finalists, 2):
        dp, dc = a.mean() - b.mean(), a.mean("confirmed") - b.mean("confirmed")
        if dp and dc:
            pairs += 1
            agree += (dp > 0) == (dc > 0)
    return agree / pairs if pairs else None


def write_spec(result: Result, path, samples_label: str) -> Path:
    """The best candidate as a spec YAML whose comments say how it was found."""
    import yaml

    lines = ["# Found by `kvcompile tune` (successive halving over the part library; the finalists confirmed by",
             "# greedy generation and the task's score).",
             f"# the proxy: {result.proxy}",
             f"# budget: {result.budget.label()}; seed {result.seed}; samples: {samples_label}",
             f"# calibration samples: {result.calibration[0]} of {result.calibration[1]}"
             + (" (those the full cache answers)" if result.calibration[0] < result.calibration[1] else ""),
             f"# rungs (candidates x samples): {', '.join(f'{c} x {s}' for c, s in result.rungs)}",
             f"# refused: {sum(result.refused.values())} candidates"
             + "".join(f"\n#   {n} x {why}" for why, n in result.refused.most_common()),
             f"# the same policy as another candidate (searched once, Policy.acting): "
             f"{sum(len(t.candidate.same) for t in result.trials)} points of the space",
             "# space:"] + [f"#   {line}" for line in result.space.describe()]
    if result.entered:
        lines.append(f"# entered beside the space: {', '.join(result.entered)}")
    if result.best.candidate.key in result.entered:
        lines.append(f"# the best is an entered candidate, {result.best.candidate.key}: no candidate of the space beat "
                     "it on the calibration samples")
    lines.append("# finalists (confirmed score, proxy):")
    for t in result.trials[:len([t for t in result.trials if t.confirmed])]:
        lines.append(f"#   {t.mean('confirmed'):6.1f}  {t.mean():8.4f}  {t.candidate.key}")
    if result.agreement is not None:
        lines.append(f"# proxy and confirmation agree on {result.agreement:.0%} of the finalists' pairs")
    lines += [f"# cost of the {kind}: {c.describe()}" for kind, c in result.cost.items()]
    Path(path).write_text("\n".join(lines) + "\n" + yaml.safe_dump(spec_mapping(result, Path(path).stem),
                                                                      sort_keys=False))
    return Path(path)


def spec_mapping(result: Result, name: str) -> dict:
    """The best candidate as a spec mapping whose budget is a ratio of the prompt: the kv fraction, or at a byte
    budget the share of entries that fills it in the candidate's storage (kept_share_for_bytes)."""
    from kvcompile.tools.ruler import kept_share_for_bytes
    from kvcompile.spec import load_spec

    mapping = dict(result.best.candidate.mapping, name=name)
    budget = {k: v for k, v in mapping["budget"].items() if k != "per_head"}
    if result.budget.kv_bytes is None:
        budget["ratio"] = result.budget.kv_fraction
    else:
        policy = load_spec(dict(mapping, budget=dict(budget, ratio=0.5)))
        budget["ratio"] = float(kept_share_for_bytes(policy, result.budget.kv_bytes, *result.geometry))
    return dict(mapping, budget=budget)


# ------------------------------------------------------------------------------------------ the plot

def reference_candidates(evaluator: Evaluator) -> tuple[list[tuple[str, Candidate]], Counter]:
    """The shipped specs and kvpress's reproduced presses as (kind, Candidate) at the evaluator's budget, and
    those a captured prefill cannot replay (a chunked prefill), counted by reason."""
    from kvcompile.spec import available_specs, load_spec, policy_to_mapping
    from kvcompile.tools.ruler import KVPRESS_REPRODUCTIONS, reproduction
    from kvcompile.tools.sweep import not_replayable

    out, skipped = [], Counter()
    n = sum(len(s.context) for s in evaluator.samples) / max(1, len(evaluator.samples))
    share = evaluator.budget.kv_fraction if evaluator.budget.kv_bytes is None else evaluator.budget.kv_bytes
    named = [("shipped", name, policy_to_mapping(load_spec(name))) for name in available_specs()]
    named += [("kvpress", f"kvpress {press}", reproduction(press, share, n)) for press in KVPRESS_REPRODUCTIONS]
    seen: dict[str, int] = {}  # a press reproduced by a shipped spec as it is: one point, both names, scored once
    for kind, name, mapping in named:
        why = not_replayable(load_spec(mapping))
        if why is not None:
            skipped[f"{name}: not replayable from one captured prefill"] += 1
            continue
        same = json.dumps({k: v for k, v in mapping.items() if k not in ("name", "description")}, sort_keys=True)
        if same in seen:
            _, first = out[seen[same]]
            out[seen[same]] = ("kvpress", Candidate(f"{first.key} = {name}", first.mapping))
            continue
        seen[same] = len(out)
        out.append((kind, Candidate(name, mapping)))
    return out, skipped


def score_references(evaluator: Evaluator, references, records=None, progress: bool = True) -> list[tuple[str, Trial]]:
    """Each reference's proxy on every calibration sample (records: as tune()'s, so a resumed run skips them);
    a reference the plan or the budget refuses keeps its reason in Trial.error."""
    from tqdm.auto import tqdm

    records = records if isinstance(records, Records) else Records(records, _proxy_name(evaluator))
    trials = [(kind, Trial(c)) for kind, c in references]
    for i in tqdm(range(len(evaluator.samples)), desc="tune: references", disable=not progress):
        for _, trial in trials:
            if trial.error is None:
                try:
                    trial.proxy[i] = records.get(trial, i, "proxy",
                                                 lambda: evaluator.proxy(trial.candidate, i))
                except (ValueError, RuntimeError) as exc:
                    trial.error = _reason(str(exc))
    return trials


def kv_share(evaluator: Evaluator, mapping: dict, indices) -> float:
    """The KV bytes a candidate's budget holds, as a share of the full cache's, mean over the samples `indices`:
    per KV head, the storage's bytes of its per_head entries against n entries in the model's dtype."""
    from kvcompile.tools.ruler import full_entry_bytes, head_bytes

    head_dim, element_size = evaluator_geometry(evaluator)
    shares = []
    for i in indices:
        n = len(evaluator.samples[i].context)
        policy = evaluator.budget.policy(mapping, n, evaluator.model)
        shares.append(head_bytes(policy.storage, policy.budget.per_head, head_dim, element_size)
                      / (n * full_entry_bytes(head_dim, element_size)))
    return sum(shares) / len(shares)


def evaluator_geometry(evaluator: Evaluator) -> tuple[int, int]:
    from kvcompile.tools.models import model_summary

    return model_summary(evaluator.model)["head_dim"], next(evaluator.model.parameters()).element_size()


def plot_points(result: Result, evaluator: Evaluator, references=()) -> list:
    """tune_plot.Points of the search's scored candidates and the scored references (score_references)."""
    from kvcompile.tools.tune_plot import Point

    every = len(evaluator.samples)
    points = []
    for kind, trial in [("candidate", t) for t in result.trials] + list(references):
        if trial.error is not None or not trial.proxy:
            continue
        points.append(Point(trial.candidate.key, kv_share(evaluator, trial.candidate.mapping, sorted(trial.proxy)),
                            trial.mean(), kind, complete=len(trial.proxy) == every))
    return points


def write_plot(result: Result, evaluator: Evaluator, path, references=()) -> Path:
    """The PNG of score against KV bytes (tune_plot.plot) for a search and its scored references."""
    from kvcompile.tools.tune_plot import plot

    title = (f"kvcompile tune: {result.budget.label()}, seed {result.seed}, {len(evaluator.samples)} samples; "
             f"best: {result.best.candidate.key}")
    return plot(plot_points(result, evaluator, references), path, "\n".join(_wrap(title, 110)),
                best=result.best.candidate.key)


def _wrap(text: str, width: int) -> list[str]:
    import textwrap

    return textwrap.wrap(text, width)

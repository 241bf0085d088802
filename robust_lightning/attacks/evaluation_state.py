"""The ``state_path`` of the reference AutoAttack: an evaluation that was stopped goes on where it was.

fra31/auto-attack and pyautoattack 0.2.0 (``pyautoattack/state.py``) keep, in a JSON file, which attacks have run
and which points are still robust; a second call with the same file runs only the attacks left, on the points
left. The file here holds the same, plus what makes a resume safe: the threat model and the number of points, which
must match, the robust accuracy after each attack and the attack that broke each point, so that the report of a
resumed run is complete, and the count of zero gradients at the attacks' starts, so that the check made after the
attacks (and the adaptive attacks it calls for) sees the attacks run before the resume. The file is
replaced atomically after the clean pass and after each attack. An attack stopped half-way is run again from its
start on the points still robust.

As in the reference, the adversarial images of points broken before the resume are not kept: the resumed call
returns the clean image for them. The reference's own files are read too (their set of attacks is written as a
Python set's text). pyautoattack 0.2.0 itself cannot resume from them, since it compares that text with a set.
"""

import ast
import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Self

FORMAT = "robust_lightning AutoAttack state 1"


@dataclass
class EvaluationState:
    """What an AutoAttack evaluation has done so far, saved in ``path``."""

    path: Path
    attacks_to_run: list[str]
    num_points: int | None  # None where a reference file recorded no flags yet
    norm: str | None = None  # None: read from a reference file, which does not record it
    eps: float | None = None
    run_attacks: list[str] = field(default_factory=list)
    robust_flags: list[bool] | None = None
    clean_accuracy: float | None = None
    robust_accuracy_after: dict[str, float] = field(default_factory=dict)
    broken_by: list[str | None] | None = None  # per point, the attack that broke it (not in the reference's files)
    # the DLR attacks' starts so far and how many had a zero gradient (the check zero_gradients, made after the
    # attacks, must count the attacks run before a resume too); not in the reference's files
    zero_gradient_starts: tuple[int, int] = (0, 0)

    @classmethod
    def open(cls, path: Path | str, attacks: tuple[str, ...], num_points: int, norm: str, eps: float) -> Self:
        """The state saved in ``path`` (checked against this evaluation), or a new one there."""
        path = Path(path)
        if not path.exists():
            return cls(path, list(attacks), num_points, norm, eps)
        try:
            saved = json.loads(path.read_text())
        except (OSError, ValueError) as error:
            raise ValueError(f"state_path {path} is not an AutoAttack state file: {error}") from error
        state = cls._from_saved(path, saved)
        if set(state.attacks_to_run) != set(attacks):
            raise ValueError(
                f"the state in {path} was made by an evaluation with the attacks {sorted(state.attacks_to_run)}, "
                f"not {sorted(attacks)}: give another state_path, or the same attacks"
            )
        made_with = {"points": state.num_points, "norm": state.norm, "eps": state.eps}
        asked = {"points": num_points, "norm": norm, "eps": eps}
        differ = [key for key in made_with if made_with[key] is not None and made_with[key] != asked[key]]
        if differ:
            raise ValueError(
                f"the state in {path} was made with {', '.join(f'{k} {made_with[k]}' for k in differ)}, "
                f"not {', '.join(f'{k} {asked[k]}' for k in differ)}: give another state_path"
            )
        return state

    @classmethod
    def _from_saved(cls, path: Path, saved: dict[str, Any]) -> Self:
        if saved.get("format") == FORMAT:
            return cls(
                path,
                saved["attacks_to_run"],
                saved["num_points"],
                saved["norm"],
                saved["eps"],
                saved["run_attacks"],
                saved["robust_flags"],
                saved["clean_accuracy"],
                saved["robust_accuracy_after"],
                saved.get("broken_by"),  # files written before it was kept have none
                tuple(saved.get("zero_gradient_starts", (0, 0))),
            )
        if "_attacks_to_run" in saved and "_robust_flags" in saved:  # fra31 / pyautoattack
            attacks = saved["_attacks_to_run"]
            attacks = ast.literal_eval(attacks) if isinstance(attacks, str) else attacks
            flags = saved["_robust_flags"]
            return cls(
                path,
                sorted(attacks),
                len(flags) if flags is not None else None,
                run_attacks=list(saved.get("_run_attacks", [])),
                robust_flags=flags,
                clean_accuracy=saved.get("_clean_accuracy"),
            )
        raise ValueError(f"state_path {path} is not an AutoAttack state file (no format or attacks in it)")

    @property
    def resumed(self) -> bool:
        return self.robust_flags is not None

    def save(self) -> None:
        """Replace the file with the current state (a kill mid-write leaves the previous one)."""
        record = {"format": FORMAT, **asdict(self)}
        record["path"] = str(self.path)
        partial = self.path.with_name(self.path.name + ".partial")
        partial.write_text(json.dumps(record))
        os.replace(partial, self.path)

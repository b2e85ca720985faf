"""Which drafter a command runs: the choice the flags of `specdec generate`, `bench` and `serve`
name (specdec.cli.common.add_drafter_arguments), and the one place that turns it into a
specdec.drafters.Drafter.

    --method plain|eagle|medusa|draft|ngram|eagle+ngram
    --head PATH (eagle, eagle+ngram)   --medusa PATH (medusa)   --draft-model PATH|self:N (draft)
    --ngram-max N --ngram-min N (ngram, eagle+ngram)

`specdec bench --drafters` names several at once, e.g. `plain,eagle,ngram,draft=self:8`
(DrafterChoice.parse). Everything checkable without the model is checked first (check()), so a
bad flag fails before the model loads.
"""

import sys
from dataclasses import dataclass, replace

from specdec.errors import InvalidRequestError

RANDOM_HEAD_SEED = 0
METHODS = ("plain", "eagle", "medusa", "draft", "ngram", "eagle+ngram")


@dataclass(frozen=True)
class DrafterChoice:
    method: str = "plain"
    head: str | None = None  # EAGLE head directory (None: the shipped one)
    medusa: str | None = None  # Medusa heads directory (None: the shipped ones)
    draft_model: str | None = None  # PATH or self:N
    ngram_max: int = 4
    ngram_min: int = 1

    @classmethod
    def from_args(cls, args) -> "DrafterChoice":
        return cls(
            args.method,
            args.head,
            getattr(args, "medusa", None),
            getattr(args, "draft_model", None),
            args.ngram_max,
            args.ngram_min,
        ).check()

    @classmethod
    def parse(cls, text: str, base: "DrafterChoice | None" = None) -> "DrafterChoice":
        """`method` or `draft=PATH|self:N` (bench's --drafters items); base: the other flags."""
        method, _, value = text.strip().partition("=")
        base = base or cls()
        if method == "draft":
            return replace(base, method=method, draft_model=value or base.draft_model).check()
        if value:
            raise InvalidRequestError(f"drafter {text!r}: only draft=PATH|self:N takes a value")
        return replace(base, method=method).check()

    def check(self) -> "DrafterChoice":
        if self.method not in METHODS:
            raise InvalidRequestError(
                f"--method {self.method!r} is not one of {', '.join(METHODS)}"
            )
        if self.method == "draft" and not self.draft_model:
            raise InvalidRequestError("--method draft needs --draft-model PATH|self:N")
        if self.method in ("ngram", "eagle+ngram"):
            for flag, v in (("--ngram-max", self.ngram_max), ("--ngram-min", self.ngram_min)):
                if v < 1:
                    raise InvalidRequestError(f"{flag} must be >= 1, got {v}")
            if self.ngram_min > self.ngram_max:
                raise InvalidRequestError(
                    f"--ngram-min ({self.ngram_min}) must be <= --ngram-max ({self.ngram_max})"
                )
        return self

    @property
    def name(self) -> str:
        """A row name: eagle, ngram:1-4, draft=self:8, ..."""
        if self.method == "draft":
            return f"draft={self.draft_model}"
        if self.method == "ngram":
            return f"ngram:{self.ngram_min}-{self.ngram_max}"
        return self.method

    def check_tree(self, tree) -> None:
        """Tree shapes a drafter cannot draft, refused before the model loads."""
        from specdec.errors import InvalidTreeSpecError

        if self.method == "eagle+ngram" and tree.kind == "chain":
            raise InvalidTreeSpecError(
                f"--method eagle+ngram needs a dynamic or adaptive --tree, got {tree}"
            )

    def build(self, model, model_path: str | None = None):
        """-> the Drafter for model (model_path: the target's path, to find shipped heads)."""
        from specdec.drafters import EagleDrafter, NgramDrafter, PlainDrafter

        if self.method == "plain":
            return PlainDrafter()
        if self.method == "ngram":
            return NgramDrafter(max_n=self.ngram_max, min_n=self.ngram_min)
        if self.method == "eagle":
            return EagleDrafter(self.eagle_head(model, model_path))
        if self.method == "eagle+ngram":
            from specdec.drafters.merged import MergedDrafter

            return MergedDrafter(
                EagleDrafter(self.eagle_head(model, model_path)),
                NgramDrafter(max_n=self.ngram_max, min_n=self.ngram_min),
            )
        if self.method == "medusa":
            from specdec.drafters.medusa import MedusaDrafter

            return MedusaDrafter(self.medusa_heads(model, model_path))
        if self.method == "draft":
            from specdec.drafters.draft_model import DraftModelDrafter

            assert self.draft_model is not None  # check() refuses draft without one
            return DraftModelDrafter.from_arg(self.draft_model, model)
        raise InvalidRequestError(f"--method {self.method} is not implemented")

    def label(self, drafter) -> str:
        """What a run's summary calls the drafter: eagle-2, ngram:1-4, draft self:8, ..."""
        head = getattr(drafter, "head", None)
        if self.method == "eagle" and head is not None:
            return f"eagle-{head.version}"
        if self.method == "eagle+ngram":
            return f"eagle+ngram:{self.ngram_min}-{self.ngram_max}"
        if self.method == "draft":
            return f"draft {drafter.label}"
        return self.name

    def medusa_heads(self, model, model_path):
        from specdec.drafters.medusa_heads import MedusaHeads, load_medusa
        from specdec.heads import resolve_head, shipped_medusa_path

        path = resolve_head(self.medusa) if self.medusa else shipped_medusa_path(model_path)
        if path:
            return load_medusa(path, model)
        print(
            "specdec: warning: no Medusa heads given and none shipped for this model; using "
            "randomly initialised heads (acceptance will be low)",
            file=sys.stderr,
        )
        return MedusaHeads.random(model, seed=RANDOM_HEAD_SEED)

    def eagle_head(self, model, model_path):
        from specdec.drafters.eagle_head import EagleHead, load_head
        from specdec.heads import resolve_head, shipped_head_path

        path = resolve_head(self.head) if self.head else shipped_head_path(model_path)
        if path:
            return load_head(path, model)
        # Models without a shipped head: a seeded random head keeps the speculative path
        # runnable end to end (acceptance length ~1).
        print(
            "specdec: warning: no EAGLE head given and none shipped for this model; using a "
            "randomly initialised head (acceptance will be low)",
            file=sys.stderr,
        )
        return EagleHead.random(model, seed=RANDOM_HEAD_SEED)

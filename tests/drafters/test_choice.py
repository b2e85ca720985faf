"""specdec.drafters.choice: the drafter flags, checked before any model loads."""

import pytest

from specdec.drafters.choice import DrafterChoice
from specdec.errors import InvalidRequestError


def test_drafter_choice_checks_before_loading():
    assert DrafterChoice.parse("draft=self:4").draft_model == "self:4"
    assert DrafterChoice.parse("ngram").name == "ngram:1-4"
    for bad in ("draft", "medusa=x", "nope"):
        with pytest.raises(InvalidRequestError):
            DrafterChoice.parse(bad)
    with pytest.raises(InvalidRequestError, match="--ngram-min"):
        DrafterChoice("ngram", ngram_max=2, ngram_min=3).check()

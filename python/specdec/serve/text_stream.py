"""A reply's text while its tokens arrive: the deltas a stream sends, each final.

A delta is never taken back, so two things are held back until the text settles:
- the last (longest stop string - 1) characters, which may be the start of a stop string (the
  engine cuts the reply before the stop string once it is complete; docs/serving.md,
  "Streaming");
- trailing U+FFFD, the decoding of a UTF-8 character whose bytes are split over tokens.
finish(final text) then sends what is left of the engine's final text.
"""


class TextStream:
    def __init__(self, tokenizer, stop: tuple = ()):
        self.tokenizer = tokenizer
        self.ids: list = []
        self.sent = ""  # the text sent so far, a prefix of the final text
        self.holdback = max((len(s) for s in stop), default=1) - 1

    def add(self, token_ids: list) -> str:
        """More tokens of a request that has not finished -> the text that is now final."""
        self.ids.extend(token_ids)
        text = self.tokenizer.decode(self.ids)
        end = len(text.rstrip("\ufffd")) - self.holdback
        if end <= len(self.sent) or not text.startswith(self.sent):
            return ""
        delta = text[len(self.sent) : end]
        self.sent += delta
        return delta

    def finish(self, final_text: str) -> str:
        """The request finished with final_text (stop string cut off) -> the rest of it."""
        if not final_text.startswith(self.sent):  # unreachable when decoding extends text
            return ""
        delta = final_text[len(self.sent) :]
        self.sent = final_text
        return delta

"""Token ids -> text deltas for streaming, with stop strings.

Text that could still be the start of a stop string is held back until it is clear, so a
stop string never reaches the user, not even in part."""
from __future__ import annotations

from localrun.tokenizer import IncrementalDetokenizer, Tokenizer


class TextStream:
    def __init__(self, tokenizer: Tokenizer, stop: tuple[str, ...] = ()):
        self._detok = IncrementalDetokenizer(tokenizer)
        self._stop = tuple(s for s in stop if s)
        self._text = ""        # everything decoded so far
        self._emitted = 0      # chars of _text already returned
        self.stopped = False   # a stop string was found; the caller should finish

    @property
    def text(self) -> str:
        return self._text[:self._emitted] if self.stopped else self._text

    def feed(self, token_id: int) -> str:
        if self.stopped:
            return ""
        self._text += self._detok.feed(token_id)
        return self._release(final=False)

    def finish(self) -> str:
        if not self.stopped:
            self._text += self._detok.flush()
        return self._release(final=True)

    def _release(self, *, final: bool) -> str:
        if self.stopped:
            return ""
        if self._stop:
            # a stop string may start at most len(stop)-1 chars before the old end
            window_start = max(0, self._emitted - max(map(len, self._stop)))
            hits = [i for s in self._stop if (i := self._text.find(s, window_start)) >= 0]
            if hits:
                self.stopped = True
                self._text = self._text[:min(hits)]
                out = self._text[self._emitted:]
                self._emitted = len(self._text)
                return out
        end = len(self._text) if final else len(self._text) - self._held_back()
        out = self._text[self._emitted:end]
        self._emitted = max(self._emitted, end)
        return out

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of a stop string."""
        best = 0
        for s in self._stop:
            for n in range(min(len(s) - 1, len(self._text) - self._emitted), best, -1):
                if self._text.endswith(s[:n]):
                    best = n
                    break
        return best

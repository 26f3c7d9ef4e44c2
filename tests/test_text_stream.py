"""Streaming text: never a broken UTF-8 character, stop strings never shown even in part."""
from localrun.text_stream import TextStream


class FakeTokenizer:
    """Token i is the byte string PIECES[i]."""
    def __init__(self, pieces):
        self.pieces = pieces

    def piece(self, token_id, *, special=False):
        return self.pieces[token_id]


def run(pieces, stop=()):
    tok = FakeTokenizer(pieces)
    stream = TextStream(tok, stop)
    deltas = []
    for i in range(len(pieces)):
        deltas.append(stream.feed(i))
        if stream.stopped:
            break
    deltas.append(stream.finish())
    return deltas, stream


def test_multibyte_character_split_across_tokens():
    emoji = "🙂".encode()                       # 4 bytes
    deltas, stream = run([b"hi ", emoji[:1], emoji[1:3], emoji[3:], b"!"])
    assert deltas == ["hi ", "", "", "🙂", "!", ""]
    assert stream.text == "hi 🙂!"
    assert all("\ufffd" not in d for d in deltas)


def test_stop_string_across_tokens_is_never_emitted():
    deltas, stream = run([b"Hello", b" wor", b"ld. ", b"END", b"more"], stop=("world. END",))
    assert "".join(deltas) == "Hello "
    assert stream.text == "Hello " and stream.stopped


def test_partial_stop_prefix_is_released_when_it_turns_out_harmless():
    # "<" and "<|" could start "<|end|>" and are held; "<|x" cannot, so it is released
    deltas, stream = run([b"a<", b"|", b"x", b"b"], stop=("<|end|>",))
    assert deltas == ["a", "", "<|x", "b", ""]
    assert stream.text == "a<|xb" and not stream.stopped


def test_earliest_of_several_stops_wins():
    _, stream = run([b"one two three"], stop=("three", "two"))
    assert stream.text == "one "


def test_invalid_bytes_become_replacement_at_the_end():
    deltas, stream = run([b"ok", b"\xe2\x82"])     # truncated euro sign
    assert "".join(deltas) == "ok\ufffd"

"""Varied text for fidelity tests and benchmarks: prose, code, numbers, non-English, emoji."""

PROSE = (
    "The history of computing is a story of abstraction. Early machines were programmed by "
    "rewiring panels; later, stored programs let the same hardware run many tasks. Compilers "
    "turned human-readable instructions into machine code, and operating systems shared one "
    "processor among many users. Today a laptop holds more memory than the largest computers "
    "of the 1970s, and a language model can run on a desktop without any network at all. "
)
CODE = '''def fibonacci(n: int) -> list[int]:
    """Return the first n Fibonacci numbers."""
    seq = [0, 1]
    while len(seq) < n:
        seq.append(seq[-1] + seq[-2])
    return seq[:n]

for i, x in enumerate(fibonacci(10)):
    print(f"{i:>3}: {x}")
'''
NUMBERS = "In 2023 the population was 8,045,311,447; pi is 3.14159265, e is 2.71828, and 17 * 23 = 391. "
FOREIGN = ("Der schnelle braune Fuchs springt über den faulen Hund. Le cœur a ses raisons que la "
           "raison ne connaît point. El niño comió una manzana. 東京は日本の首都です。 Привет, мир! ")
EMOJI = "Weather today: ☀️ then 🌧️, later 🌈. Café, naïve, façade — “quotes” and ‘apostrophes’…\t\ttabs   and    spaces\n\n\n"

CORPUS = PROSE + CODE + NUMBERS + FOREIGN + EMOJI

TOKENIZER_CASES = [
    "", " ", "  ", "\n", "\n\n\t  \n", "Hello, world!", " leading space", "trailing space ",
    "multiple     spaces", "tabs\tand\ttabs", "CamelCaseIdentifier_with_snake", "x += 1  # comment",
    "<|im_start|>user\nHi<|im_end|>", "😀😃😄😁", "👩‍👩‍👧‍👦 family", "日本語のテキスト", "Ελληνικά", "עברית",
    "1234567890 3.14159 -42 1e-10", "http://example.invalid/path?q=1&r=2", "' ' '' \"\" ``` ```",
    PROSE, CODE, NUMBERS, FOREIGN, EMOJI, CORPUS,
]

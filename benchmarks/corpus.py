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

PROSE_2 = (
    "Bread is one of the oldest prepared foods. Flour and water are mixed into a dough, which "
    "is left to rise before it is baked; yeast turns sugars into carbon dioxide, and the gas "
    "bubbles give the loaf its soft crumb. Sourdough relies on wild yeast and bacteria, which "
    "add a slightly sour taste. Bakers have argued for centuries about the best flour to use. "
)
CODE_2 = """SELECT customer_id, COUNT(*) AS orders, SUM(total) AS revenue
FROM orders
WHERE created_at >= '2024-01-01'
GROUP BY customer_id
HAVING COUNT(*) > 3
ORDER BY revenue DESC;

const add = (a, b) => a + b;
console.log([1, 2, 3].map(x => add(x, 10)));
"""
NUMBERS_2 = ("| year | revenue | growth |\n|------|---------|--------|\n| 2021 | 1,204 | 4.5% |\n"
             "| 2022 | 1,388 | 15.3% |\n| 2023 | 1,512 | 8.9% |\n")

# teacher-forced fidelity text: prose, code, numbers and non-English (the tokenizer cases
# below add emoji and whitespace runs)
FIDELITY_TEXT = PROSE + CODE + NUMBERS + FOREIGN + PROSE_2 + CODE_2 + NUMBERS_2
CORPUS = PROSE + CODE + NUMBERS + FOREIGN + EMOJI

TOKENIZER_CASES = [
    "", " ", "  ", "\n", "\n\n\t  \n", "Hello, world!", " leading space", "trailing space ",
    "multiple     spaces", "tabs\tand\ttabs", "CamelCaseIdentifier_with_snake", "x += 1  # comment",
    "<|im_start|>user\nHi<|im_end|>", "😀😃😄😁", "👩‍👩‍👧‍👦 family", "日本語のテキスト", "Ελληνικά", "עברית",
    "1234567890 3.14159 -42 1e-10", "http://example.invalid/path?q=1&r=2", "' ' '' \"\" ``` ```",
    PROSE, CODE, NUMBERS, FOREIGN, EMOJI, CORPUS,
]

"""Writes data/corpus/preference_demo.jsonl, the shipped preference set: 200 short conversational pairs in TRL's
format, {"id": ..., "prompt": [messages], "chosen": [the assistant's reply], "rejected": [another reply]}. The chosen
reply is polite and correct, the rejected one wrong (stated politely), rude (and right), or both, so that a model
can learn the preference from a few hundred steps on a CPU.

    python data/corpus/make_preference_demo.py      # the same bytes every time (a seeded generator, sorted tables)

Text and licence: written for this project from common facts (arithmetic, capitals, opposites, the days of the
week and the months, the names of young animals, plurals, greetings); nothing is taken from another source. Its authors dedicate the
script and the set to the public domain (CC0 1.0 Universal).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

OUTPUT = Path(__file__).with_name("preference_demo.jsonl")
SEED = 42

CAPITALS = {"Argentina": "Buenos Aires", "Australia": "Canberra", "Austria": "Vienna", "Brazil": "Brasilia",
            "Canada": "Ottawa", "Chile": "Santiago", "Egypt": "Cairo", "Finland": "Helsinki", "France": "Paris",
            "Germany": "Berlin", "Greece": "Athens", "India": "New Delhi", "Ireland": "Dublin", "Italy": "Rome",
            "Japan": "Tokyo", "Kenya": "Nairobi", "Mexico": "Mexico City", "Norway": "Oslo", "Peru": "Lima",
            "Poland": "Warsaw", "Portugal": "Lisbon", "Spain": "Madrid", "Sweden": "Stockholm", "Thailand": "Bangkok",
            "Turkey": "Ankara"}
OPPOSITES = {"hot": "cold", "big": "small", "fast": "slow", "light": "dark", "happy": "sad", "early": "late",
             "full": "empty", "open": "closed", "hard": "soft", "up": "down", "old": "young", "wet": "dry",
             "strong": "weak", "loud": "quiet", "rich": "poor", "high": "low", "thick": "thin", "near": "far",
             "clean": "dirty", "long": "short"}
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
YOUNG = {"cat": "kitten", "dog": "puppy", "cow": "calf", "horse": "foal", "sheep": "lamb", "goat": "kid",
         "duck": "duckling", "frog": "tadpole", "kangaroo": "joey", "swan": "cygnet", "bear": "cub", "owl": "owlet",
         "deer": "fawn", "goose": "gosling", "pig": "piglet"}
PLURALS = {"mouse": "mice", "child": "children", "foot": "feet", "tooth": "teeth", "man": "men", "woman": "women",
           "person": "people", "goose": "geese", "ox": "oxen", "leaf": "leaves", "knife": "knives", "wolf": "wolves",
           "cactus": "cacti", "fish": "fish", "box": "boxes"}
GREETINGS = [
    ("Hi, how are you?", "I'm well, thank you for asking! How can I help you today?", "What do you want?"),
    ("Good morning!", "Good morning! I hope your day is off to a nice start.", "Is it? I hadn't noticed."),
    ("Thanks for your help.", "You're very welcome. I'm glad I could help.", "Finally, you noticed."),
    ("Can you help me?", "Of course. What do you need help with?", "Probably not, but go on."),
    ("Sorry for the trouble.", "No trouble at all. Happy to help.", "Yes, you are quite a lot of trouble."),
    ("I made a mistake in my essay.", "That happens to everyone. Would you like help fixing it?",
     "Of course you did."),
    ("Goodbye!", "Goodbye, and take care!", "Finally."),
    ("I passed my exam!", "Congratulations! All your work paid off.", "So? Lots of people pass exams."),
    ("Can you say that again, please?", "Certainly. I'll repeat it more slowly.", "I already said it. Pay attention."),
    ("I feel a bit tired today.", "I'm sorry to hear that. A short rest might help.", "Not my problem."),
]
RUDE = ["Figure it out yourself.", "Why would I tell you that?", "Everyone knows that. Look it up.",
        "That is a silly question.", "Ask someone else."]
SYSTEM = ["You are a helpful assistant.", "You are a friendly assistant. Answer briefly.", None, None]


def arithmetic(rng: random.Random) -> tuple[str, str, str]:
    a, b = sorted((rng.randint(2, 20), rng.randint(2, 20)), reverse=True)
    question, right = rng.choice([(f"What is {a} plus {b}?", a + b), (f"What is {a} minus {b}?", a - b),
                                  (f"What is {a} times {b}?", a * b)])
    words = question[8:-1]
    return question, f"{words} is {right}.", f"{words} is {right + rng.choice([-2, -1, 1, 2, 10])}."


def facts(rng: random.Random) -> list[tuple[str, str, str]]:
    """(question, the polite right answer, the same answer made wrong) of every table, in a fixed order."""
    rows = [arithmetic(rng) for _ in range(77)]
    names = sorted(CAPITALS)
    rows += [(f"What is the capital of {country}?", f"The capital of {country} is {CAPITALS[country]}.",
              f"The capital of {country} is {CAPITALS[names[(i + 7) % len(names)]]}.")
             for i, country in enumerate(names)]
    words = sorted(OPPOSITES)
    rows += [(f"What is the opposite of {word}?", f"The opposite of {word} is {OPPOSITES[word]}.",
              f"The opposite of {word} is {OPPOSITES[words[(i + 3) % len(words)]]}.") for i, word in enumerate(words)]
    rows += [(f"What day comes after {day}?", f"The day after {day} is {DAYS[(i + 1) % 7]}.",
              f"The day after {day} is {DAYS[(i + 3) % 7]}.") for i, day in enumerate(DAYS)]
    rows += [(f"What day comes before {day}?", f"The day before {day} is {DAYS[(i - 1) % 7]}.",
              f"The day before {day} is {DAYS[(i + 2) % 7]}.") for i, day in enumerate(DAYS)]
    rows += [(f"Which month comes after {month}?", f"The month after {month} is {MONTHS[(i + 1) % 12]}.",
              f"The month after {month} is {MONTHS[(i + 4) % 12]}.") for i, month in enumerate(MONTHS)]
    rows += [(f"Which month comes before {month}?", f"The month before {month} is {MONTHS[(i - 1) % 12]}.",
              f"The month before {month} is {MONTHS[(i + 5) % 12]}.") for i, month in enumerate(MONTHS)]
    animals = sorted(YOUNG)
    rows += [(f"What is a young {animal} called?", f"A young {animal} is called a {YOUNG[animal]}.",
              f"A young {animal} is called a {YOUNG[animals[(i + 5) % len(animals)]]}.")
             for i, animal in enumerate(animals)]
    rows += [(f"What is the plural of {word}?", f"The plural of {word} is {PLURALS[word]}.",
              f"The plural of {word} is {word}s.") for word in sorted(PLURALS)]
    return rows


def pairs(rng: random.Random) -> list[dict]:
    """200 records: 190 facts (rejected: wrong, rude, or both, in turn) and 10 greetings (rejected: rude)."""
    records = []
    for number, (question, right, wrong) in enumerate(facts(rng)):
        style = number % 3
        rejected = [wrong, rng.choice(RUDE), f"{rng.choice(RUDE)} {wrong}"][style]
        records.append((question, right, rejected))
    records += GREETINGS
    assert len(records) == 200, len(records)
    rng.shuffle(records)
    out = []
    for number, (question, chosen, rejected) in enumerate(records):
        prompt = []
        system = rng.choice(SYSTEM)
        if system:
            prompt.append({"role": "system", "content": system})
        if number % 5 == 0:  # one in five follows an earlier exchange
            earlier, answer, _ = records[(number + 1) % len(records)]
            prompt += [{"role": "user", "content": earlier}, {"role": "assistant", "content": answer}]
        prompt.append({"role": "user", "content": question})
        out.append({"id": f"preference-demo-{number:03d}", "prompt": prompt,
                    "chosen": [{"role": "assistant", "content": chosen}],
                    "rejected": [{"role": "assistant", "content": rejected}]})
    return out


def main() -> None:
    records = pairs(random.Random(SEED))
    OUTPUT.write_text("".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records), encoding="utf-8")
    print(f"{OUTPUT}: {len(records)} pairs")


if __name__ == "__main__":
    main()

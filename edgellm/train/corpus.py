"""A seeded generator of short, consistent English stories: the demo's training corpus.

Every story follows one hero (and a friend) through a few episodes: counting with gifts, finds and losses,
comparisons, pets and animal facts, questions with their answers, places and feelings. The state is
tracked, so the text is consistent: pronouns follow the names, counts add up ("Tom has three red apples.
He gives one to Mia. Now Tom has two red apples."), a colour named once stays the colour. A small model
can learn much of that structure, which is what pushes its loss well below the unigram entropy.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

NUMBERS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]
BOYS = ["Tom", "Ben", "Sam", "Max", "Leo", "Jack", "Tim", "Dan", "Finn", "Noah", "Paul", "Luke"]
GIRLS = ["Mia", "Lily", "Anna", "Emma", "Sara", "Lucy", "Zoe", "Amy", "Ella", "Rosa", "Kate", "Nina"]
COLOURS = ["red", "blue", "green", "yellow", "pink", "white", "black", "orange", "purple", "brown"]
ADJECTIVES = ["kind", "happy", "little", "brave", "funny", "clever", "quiet", "curious"]
HOMES = ["in a small house", "near the sea", "on a big farm", "in a busy town", "next to the forest"]
# countable things: singular -> plural
THINGS = {"apple": "apples", "ball": "balls", "book": "books", "cup": "cups", "hat": "hats", "box": "boxes",
          "flower": "flowers", "shell": "shells", "car": "cars", "kite": "kites", "sock": "socks",
          "pencil": "pencils", "star": "stars", "cookie": "cookies"}
# animal -> (colours it comes in, what it does, its number of legs)
ANIMALS = {
    "cat": (["black", "white", "orange", "grey"], "likes to sleep in the sun", 4),
    "dog": (["brown", "black", "white"], "barks at the postman", 4),
    "bird": (["blue", "yellow", "red"], "sings in the morning", 2),
    "fish": (["orange", "gold", "silver"], "swims round and round", 0),
    "rabbit": (["white", "brown", "grey"], "eats carrots", 4),
    "duck": (["yellow", "white"], "swims in the pond", 2),
    "frog": (["green"], "jumps very high", 4),
    "horse": (["brown", "black", "white"], "runs very fast", 4),
}
# place -> what friends do there
PLACES = {
    "park": "play on the swings", "beach": "build a big sand castle", "forest": "look for birds",
    "shop": "buy some bread and milk", "school": "read a story together", "farm": "feed the cows",
    "river": "throw stones into the water", "library": "find a book about stars",
    "garden": "water the flowers", "zoo": "see the lions and the monkeys",
}
# question -> answer (simple facts, always the same)
FACTS = [
    ("What colour is the sky?", "The sky is blue."),
    ("What colour is the grass?", "The grass is green."),
    ("What colour is snow?", "Snow is white."),
    ("What colour is a banana?", "A banana is yellow."),
    ("Where do fish live?", "Fish live in the water."),
    ("What does a cow give us?", "A cow gives us milk."),
    ("What do bees make?", "Bees make honey."),
    ("How many days are in a week?", "There are seven days in a week."),
    ("Is the sun hot or cold?", "The sun is very hot."),
    ("Is ice hot or cold?", "Ice is very cold."),
    ("What do birds have?", "Birds have wings and feathers."),
    ("When do we sleep?", "We sleep at night."),
]
FOODS = ["an apple", "some bread", "a banana", "some soup", "a cookie", "some rice"]
# feeling -> what the hero does about it ({p} = his/her)
FEELINGS = {
    "hungry": "eats {food}", "tired": "goes to bed early", "cold": "puts on {p} {colour} hat",
    "thirsty": "drinks a cup of water", "sad": "gives {p} mother a big hug",
}


@dataclass
class Person:
    name: str
    girl: bool

    @property
    def he(self) -> str:
        return "she" if self.girl else "he"

    @property
    def his(self) -> str:
        return "her" if self.girl else "his"

    @property
    def him(self) -> str:
        return "her" if self.girl else "him"


def _cap(s: str) -> str:
    return s[0].upper() + s[1:]


def _a(word: str) -> str:
    """'a red ...' / 'an orange ...'."""
    return f"an {word}" if word[0] in "aeiou" else f"a {word}"


def _count(n: int, colour: str, thing: str) -> str:
    """'one red apple', 'three red apples', 'no red apples'."""
    noun = thing if n == 1 else THINGS[thing]
    return f"{'no' if n == 0 else NUMBERS[n]} {colour} {noun}".replace("  ", " ")


def _give(r: random.Random, a: Person, b: Person) -> str:
    thing, colour = r.choice(list(THINGS)), r.choice(COLOURS)
    n = r.randint(2, 10)
    k = r.randint(1, n - 1)
    return (f"{a.name} has {_count(n, colour, thing)}. {_cap(a.he)} gives {NUMBERS[k]} to {b.name}. "
            f"Now {a.name} has {_count(n - k, colour, thing)}, and {b.name} has {_count(k, colour, thing)}.")


def _find(r: random.Random, a: Person, place: str) -> str:
    thing, colour = r.choice(list(THINGS)), r.choice(COLOURS)
    n = r.randint(1, 6)
    k = r.randint(1, 10 - n)
    return (f"At the {place}, {a.name} finds {_count(n, colour, thing)}. Then {a.he} finds {NUMBERS[k]} more. "
            f"Now {a.he} has {_count(n + k, colour, thing)}.")


def _lose(r: random.Random, a: Person) -> str:
    thing, colour = r.choice(list(THINGS)), r.choice(COLOURS)
    n = r.randint(2, 10)
    k = r.randint(1, n)
    rest = f"{a.he} has {_count(n - k, colour, thing)} left" if k < n else f"{a.he} has no {THINGS[thing]} left"
    return (f"{a.name} has {_count(n, colour, thing)}, but {a.he} loses {NUMBERS[k]} on the way home. "
            f"Now {rest}. {a.name} is sad.")


def _compare(r: random.Random, a: Person, b: Person) -> str:
    thing = r.choice(list(THINGS))
    n, m = r.sample(range(1, 11), 2)
    more, less = (a, b) if n > m else (b, a)
    return (f"{a.name} has {NUMBERS[n]} {THINGS[thing] if n > 1 else thing}. "
            f"{b.name} has {NUMBERS[m]} {THINGS[thing] if m > 1 else thing}. "
            f"{more.name} has more {THINGS[thing]} than {less.name}.")


def _pet(r: random.Random, a: Person) -> str:
    animal = r.choice(list(ANIMALS))
    colours, habit, legs = ANIMALS[animal]
    colour = r.choice(colours)
    name = r.choice(["Spot", "Sunny", "Button", "Pip", "Coco", "Bella", "Milo", "Daisy"])
    legs_text = f"The {animal} has {NUMBERS[legs]} legs." if legs else f"A {animal} has no legs."
    return (f"{a.name} has {_a(colour)} {animal} called {name}. {name} {habit}. {legs_text} "
            f"{a.name} loves {a.his} {colour} {animal} very much.")


def _ask(r: random.Random, a: Person, b: Person) -> str:
    question, answer = r.choice(FACTS)
    return f'{b.name} asks {a.name}, "{question}" {a.name} says, "{answer}"'


def _visit(r: random.Random, a: Person, b: Person, place: str) -> str:
    return (f"One day, {a.name} and {b.name} go to the {place}. At the {place}, they {PLACES[place]}. "
            f'{b.name} says, "I like the {place}!"')


def _feel(r: random.Random, a: Person) -> str:
    feeling = r.choice(list(FEELINGS))
    act = FEELINGS[feeling].format(food=r.choice(FOODS), p=a.his, colour=r.choice(COLOURS))
    return f"{a.name} is {feeling}, so {a.he} {act}."


def _swap(r: random.Random, a: Person, b: Person) -> str:
    thing = r.choice(list(THINGS))
    c1, c2 = r.sample(COLOURS, 2)
    return (f"{a.name} has {_a(c1)} {thing} and {b.name} has {_a(c2)} {thing}. They swap. "
            f"Now {a.name} has the {c2} {thing}, and {b.name} has the {c1} {thing}.")


def story(r: random.Random) -> str:
    """One story: intro, two to four episodes, an ending. Uses only `r`, so it is reproducible."""
    girl = r.random() < 0.5
    a = Person(r.choice(GIRLS if girl else BOYS), girl)
    fgirl = r.random() < 0.5
    b = Person(r.choice([n for n in (GIRLS if fgirl else BOYS) if n != a.name]), fgirl)
    place = r.choice(list(PLACES))
    parts = [
        f"{a.name} is {_a(r.choice(ADJECTIVES))} {'girl' if a.girl else 'boy'} who lives {r.choice(HOMES)}.",
        f"{_cap(a.his)} best friend is {b.name}.",
    ]
    episodes = [
        lambda: _give(r, a, b), lambda: _give(r, b, a), lambda: _find(r, a, place), lambda: _lose(r, a),
        lambda: _compare(r, a, b), lambda: _pet(r, a), lambda: _ask(r, a, b), lambda: _visit(r, a, b, place),
        lambda: _feel(r, a), lambda: _feel(r, b), lambda: _swap(r, a, b),
    ]
    for i in r.sample(range(len(episodes)), r.randint(2, 4)):
        parts.append(episodes[i]())
    ending = r.choice([
        f"At the end of the day, {a.name} and {b.name} go home.",
        f"{a.name} smiles. It is a good day.",
        f"Then {a.name} says goodbye to {b.name} and goes home.",
    ])
    parts.append(ending)
    return " ".join(parts)


def generate_corpus(n_stories: int, seed: int) -> list[str]:
    """`n_stories` stories, the same list for the same seed (one `random.Random(seed)` drives everything)."""
    r = random.Random(seed)
    return [story(r) for _ in range(n_stories)]


def write_corpus(path: str, n_stories: int, seed: int) -> None:
    """Stories one per paragraph (separated by a blank line): the document boundary `data.py` splits on."""
    with open(path, "w", encoding="utf-8") as fh:
        fh.write("\n\n".join(generate_corpus(n_stories, seed)) + "\n")

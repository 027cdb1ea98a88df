"""The bundled prompt set of ``specgate bench workload``: six categories, eight chat requests each, short
passages (a 2-core machine decodes rather than prefills); the categories differ in how much the answer
repeats its context — what lookup drafting lives on."""

from __future__ import annotations

Messages = list[dict[str, str]]


def _user(text: str) -> Messages:
    return [{"role": "user", "content": text}]


_PASSAGES = [
    "The Amazon rainforest covers about 5.5 million square kilometres across nine countries. It holds around "
    "390 billion trees of 16,000 species. Brazil has about 60 percent of the forest, Peru 13 percent and "
    "Colombia 10 percent. Scientists call it the lungs of the planet because it stores vast "
    "amounts of carbon.",
    "The first Tour de France was held in 1903. It had six stages and 60 riders, and Maurice Garin won it. "
    "Today the race lasts three weeks and covers about 3,500 kilometres. The leader wears a yellow jersey, "
    "the best climber a polka-dot jersey and the best sprinter a green jersey.",
    "Honeybees live in colonies of up to 60,000 bees. A colony has one queen, a few hundred drones and many "
    "workers. Workers collect nectar and pollen, build the comb and guard the hive. The queen lays up to "
    "2,000 eggs a day. Bees tell each other where flowers are with a waggle dance.",
    "The Great Wall of China was built over many centuries, mostly during the Ming dynasty from "
    "1368 to 1644. "
    "Its main line is about 8,850 kilometres long. It was made of stone, brick, earth and wood. Soldiers "
    "used towers along the wall to send smoke signals when enemies came near.",
    "Mount Everest is 8,849 metres high, the highest mountain above sea level. It lies on the border of "
    "Nepal and China. Tenzing Norgay and Edmund Hillary first reached the top in 1953. Every spring, "
    "hundreds of climbers try to reach the summit, and the weather decides when they can go.",
    "The Moon is about 384,400 kilometres from Earth. It takes 27.3 days to orbit our planet and always "
    "shows us the same face. Its gravity causes the tides in the oceans. Twelve astronauts walked on the "
    "Moon between 1969 and 1972 during the Apollo missions.",
    "Coffee was first drunk in Yemen in the fifteenth century. Today Brazil grows more coffee than any other "
    "country, followed by Vietnam and Colombia. The two main kinds of beans are arabica and robusta. "
    "Arabica has a softer taste, and robusta has more caffeine.",
    "The Python language was created by Guido van Rossum and first released in 1991. It is known for its "
    "clear syntax and its large standard library. Python is used for web servers, data analysis, machine "
    "learning and scripting. Its name comes from the comedy group Monty Python.",
]

_QUESTIONS = [
    "How many countries does the Amazon rainforest cover, and which country has the largest share?",
    "Who won the first Tour de France, and what does the best climber wear?",
    "How many eggs can a queen bee lay in a day, and how do bees tell each other where flowers are?",
    "During which dynasty was most of the Great Wall built, and how long is its main line?",
    "How high is Mount Everest, and who first reached its top?",
    "How long does the Moon take to orbit the Earth, and what does its gravity cause?",
    "Where was coffee first drunk, and which kind of bean has more caffeine?",
    "Who created Python, and where does its name come from?",
]

_CODE = [
    (
        "Rename the variable `total` to `running_sum` everywhere in this function and return the code.",
        "def add_all(values):\n    total = 0\n    for value in values:\n        total = total + "
        "value\n    return total\n",
    ),
    (
        "Add type hints to this function (a list of floats in, a float out) and return the whole function.",
        "def average(numbers):\n    if not numbers:\n        return 0.0\n    return sum(numbers) "
        "/ len(numbers)\n",
    ),
    (
        "Change this function so it skips empty lines, and return the full code.",
        "def read_lines(path):\n    out = []\n    with open(path) as f:\n        for line in "
        "f:\n            out.append(line.strip())\n    return out\n",
    ),
    (
        "Add a docstring to this class and return the whole class unchanged otherwise.",
        "class Counter:\n    def __init__(self):\n        self.count = 0\n\n    def "
        "increment(self):\n        self.count += 1\n        return self.count\n",
    ),
    (
        "Rewrite this loop as a list comprehension and return the function.",
        "def squares(n):\n    result = []\n    for i in range(n):\n        result.append(i * "
        "i)\n    return result\n",
    ),
    (
        "Fix the bug in this function (it should return the largest value) and return the code.",
        "def largest(values):\n    best = values[0]\n    for value in values:\n        if value "
        "< best:\n            best = value\n    return best\n",
    ),
    (
        "Add a `reset` method to this class that sets the count back to zero, and return the whole class.",
        "class Counter:\n    def __init__(self):\n        self.count = 0\n\n    def "
        "increment(self):\n        self.count += 1\n        return self.count\n",
    ),
    (
        "Make this function case-insensitive and return the code.",
        "def contains_word(text, word):\n    for token in text.split():\n        if token == "
        "word:\n            return True\n    return False\n",
    ),
]

_SENTENCES = [
    "The train leaves the station at seven in the morning.",
    "My sister likes to read books in the garden.",
    "We are going to the market to buy fresh bread and cheese.",
    "The weather is cold today, so take a warm coat.",
    "He opened the window because the room was too hot.",
    "Our teacher gave us a lot of homework for the weekend.",
    "The museum is closed on Mondays and open every other day.",
    "Please call me when you arrive at the hotel.",
]

_LANGUAGES = ["French", "Spanish", "German", "Italian", "French", "Spanish", "German", "Portuguese"]

_MATH = [
    "A shop sells pencils at 3 for $1. How much do 18 pencils cost? Think step by step.",
    "Tom has 24 apples. He gives a third of them to Anna and half of what is left to Ben. How "
    "many apples does Tom keep? Show your steps.",
    "A train travels 60 km in 45 minutes. What is its speed in km per hour? Explain step by step.",
    "What is 15% of 240? Show the calculation step by step.",
    "A rectangle is 8 cm long and 5 cm wide. What are its area and its perimeter? Work it out step by step.",
    "If x + 7 = 19, what is 3x? Solve it step by step.",
    "A class has 30 students and 40% of them are boys. How many girls are there? Show your reasoning.",
    "Sarah reads 12 pages a day. How many days does she need to read a 180-page book? Explain step by step.",
]

_CHATS: list[Messages] = [
    [
        {"role": "user", "content": "I want to start running. How often should I run in the first month?"},
        {
            "role": "assistant",
            "content": "Start with three short runs a week, with a rest day between them, and walk when you "
            "need to.",
        },
        {"role": "user", "content": "And how long should each of those three runs be?"},
    ],
    [
        {"role": "user", "content": "What is a good name for a small grey cat?"},
        {
            "role": "assistant",
            "content": "Some good names for a small grey cat are Smoky, Misty, Pebble and Ash.",
        },
        {"role": "user", "content": "I like Pebble. Can you give me three more names like Pebble?"},
    ],
    [
        {"role": "user", "content": "Can you suggest a simple dinner with pasta?"},
        {
            "role": "assistant",
            "content": "Try pasta with garlic, olive oil, cherry tomatoes and basil. It takes about fifteen "
            "minutes.",
        },
        {"role": "user", "content": "I have no basil. What can I use instead of basil?"},
    ],
    [
        {"role": "user", "content": "How do I keep my houseplants alive?"},
        {
            "role": "assistant",
            "content": "Give them bright indirect light, water them when the top of the soil is dry, and do "
            "not let them stand in water.",
        },
        {"role": "user", "content": "How often is that for a plant in a sunny room?"},
    ],
    [
        {"role": "user", "content": "What should I pack for a weekend in the mountains?"},
        {
            "role": "assistant",
            "content": "Pack warm layers, a rain jacket, good walking shoes, a hat, water and some snacks.",
        },
        {"role": "user", "content": "Thanks. And what should I pack for a weekend at the beach?"},
    ],
    [
        {"role": "user", "content": "Tell me one fact about the ocean."},
        {"role": "assistant", "content": "The ocean covers about 71 percent of the Earth's surface."},
        {"role": "user", "content": "Tell me one more fact about the ocean."},
    ],
    [
        {"role": "user", "content": "I am learning to play the guitar. What should I practise first?"},
        {
            "role": "assistant",
            "content": "Practise a few basic chords first: G, C, D and E minor. Change between them slowly.",
        },
        {"role": "user", "content": "How long should I practise those chords each day?"},
    ],
    [
        {"role": "user", "content": "How can I sleep better?"},
        {
            "role": "assistant",
            "content": "Go to bed at the same time every night, keep your room dark and cool, and avoid "
            "screens before bed.",
        },
        {"role": "user", "content": "Can you repeat those tips as a short numbered list?"},
    ],
]

PROMPTS: dict[str, list[Messages]] = {
    "multi-turn chat": _CHATS,
    "translation": [
        _user(f"Translate into {language}: {sentence}") for sentence, language in zip(_SENTENCES, _LANGUAGES)
    ],
    "summarization": [_user(f"Summarize this text in two sentences:\n\n{passage}") for passage in _PASSAGES],
    "passage QA": [
        _user(f"Read the text and answer the question.\n\nText: {passage}\n\nQuestion: {question}")
        for passage, question in zip(_PASSAGES, _QUESTIONS)
    ],
    "math reasoning": [_user(problem) for problem in _MATH],
    "code editing": [_user(f"{task}\n\n```python\n{code}```") for task, code in _CODE],
}

"""The self-distillation prompt set: templates x topics, five kinds of request, built by a seeded
draw so `python -m engine.train prompts` rewrites prompts.jsonl byte for byte.

Each prompt is {"id", "category", "split", "prompt"}; split "heldout" prompts are never trained
on: the cards' accuracies and the benchmarks read them.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

PROMPTS_FILE = Path(__file__).with_name("prompts.jsonl")
PER_CATEGORY = 72  # prompts per category and round
ROUNDS = 2
HELDOUT_EVERY = 8  # one prompt in eight is held out

SUBJECTS = [
    "the water cycle", "photosynthesis", "black holes", "the French Revolution", "compound interest",
    "machine learning", "volcanoes", "the immune system", "electric cars", "the printing press",
    "climate change", "honey bees", "the internet", "plate tectonics", "vaccines", "the Roman Empire",
    "solar panels", "sleep", "coffee", "the moon landing", "recycling", "rainbows", "earthquakes",
    "the stock market", "DNA", "the human heart", "airplanes", "chess", "the Great Wall of China",
    "electricity", "gravity", "the ocean tides", "inflation", "music theory", "bread baking",
    "renewable energy", "the Olympic Games", "dinosaurs", "time zones", "public libraries",
]
SITUATIONS = [
    "I have a job interview tomorrow", "I want to start running", "my plants keep dying",
    "I can't focus when I study", "I'm moving to a new city", "I want to learn to cook",
    "I feel tired every afternoon", "I want to save more money", "I'm planning a birthday party",
    "I have too many emails", "I want to read more books", "my team keeps missing deadlines",
    "I want to learn a new language", "I'm nervous about public speaking", "I need a weekend plan",
    "my laptop is very slow", "I want to eat healthier", "I'm starting my first programming job",
]
CODE_TASKS = [
    "reverse a string", "check whether a number is prime", "compute the factorial of n",
    "find the largest number in a list", "count the vowels in a string", "merge two sorted lists",
    "remove duplicates from a list", "check whether a word is a palindrome", "sum the digits of a number",
    "convert Celsius to Fahrenheit", "compute the n-th Fibonacci number", "flatten a nested list",
    "count word frequencies in a text", "find the second smallest element of a list",
    "check whether two strings are anagrams", "compute the average of a list of numbers",
    "read a text file and count its lines", "sort a list of dictionaries by a key",
    "validate an email address with a regular expression", "compute the greatest common divisor",
]
LANGUAGES = ["Python", "Python", "Python", "JavaScript", "C", "Rust", "Java", "Go"]
PASSAGES = [
    "The meeting is moved to Thursday because many people are away on Tuesday.",
    "Our store will be closed for renovations next week, but online orders will still ship.",
    "The results of the experiment were not what we expected, so we will repeat it with more samples.",
    "Please remember to turn off the lights and lock the door when you leave the office.",
    "The new update makes the app faster and fixes the bug that crashed it on startup.",
    "I am writing to ask whether the position you advertised last month is still open.",
    "The train was late again this morning, and I missed the first half of the lecture.",
    "Our team finished the project two weeks early and under budget.",
    "The park will host a free concert on Saturday evening for all residents.",
    "Due to heavy rain, the football match has been postponed until further notice.",
    "The library has extended its opening hours during the exam period.",
    "We are looking for volunteers to help clean the beach next Sunday morning.",
]
STYLES = ["formal", "friendly", "concise", "enthusiastic", "polite", "simple"]

TEMPLATES = {
    "chat": [
        "Hi! Can you tell me something interesting about {subject}?",
        "{situation}. Any advice?",
        "What do you think is the most important thing to know about {subject}?",
        "{situation}. What should I do first?",
        "Can you help me? {situation}.",
        "I'm curious about {subject}. Where should I start?",
        "Tell me a fun fact about {subject}.",
        "How are you today? Also, what's your favourite thing about {subject}?",
        "{situation}. Can you give me a simple plan?",
    ],
    "code": [
        "Write a {language} function to {task}.",
        "How do I {task} in {language}? Show a short example.",
        "Write {language} code to {task}, with a comment on each step.",
        "Explain how to {task} in {language}, then show the code.",
        "Give me a simple {language} snippet that can {task}.",
        "Write a {language} function to {task} and a small test for it.",
    ],
    "lists": [
        "List five facts about {subject}.",
        "Give me a list of tips: {situation}.",
        "List three advantages and three disadvantages of {subject}.",
        "What are the main steps to understand {subject}? Use a numbered list.",
        "Make a checklist for this situation: {situation}.",
        "Name five words related to {subject}, with a short definition of each.",
        "List some common questions people ask about {subject}.",
    ],
    "rewriting": [
        "Rewrite this sentence in a {style} tone: {passage}",
        "Summarize in one sentence: {passage}",
        "Make this text more {style}: {passage}",
        "Correct and improve this text: {passage}",
        "Turn this into a short email: {passage}",
        "Paraphrase the following: {passage}",
        "Rewrite this for a child to understand: {passage}",
    ],
    "explanations": [
        "Explain {subject} in simple terms.",
        "How does {subject} work?",
        "Why is {subject} important?",
        "Explain {subject} to a ten-year-old.",
        "What is the history of {subject}?",
        "Describe {subject} in three short paragraphs.",
        "What are common misconceptions about {subject}?",
        "Compare {subject} and {other} in a few sentences.",
    ],
}


def _fill(template: str, rng: random.Random) -> str:
    subject, other = rng.sample(SUBJECTS, 2)
    return template.format(
        subject=subject, other=other, situation=rng.choice(SITUATIONS), task=rng.choice(CODE_TASKS),
        language=rng.choice(LANGUAGES), passage=rng.choice(PASSAGES), style=rng.choice(STYLES),
    )


def _round(rng: random.Random, earlier: dict[str, set[str]]) -> dict[str, list[str]]:
    """PER_CATEGORY new distinct prompts per category, none seen in an earlier round."""
    drawn = {}
    for category, templates in TEMPLATES.items():
        seen: set[str] = set()
        while len(seen) < PER_CATEGORY:
            text = _fill(rng.choice(templates), rng)
            if text not in earlier.get(category, set()):
                seen.add(text)
        chosen = sorted(seen)
        rng.shuffle(chosen)
        drawn[category] = chosen
    return drawn


def build_prompts(seed: int = 0) -> list[dict]:
    """ROUNDS x PER_CATEGORY distinct prompts per category, categories interleaved; every
    HELDOUT_EVERY-th is held out. A later round only appends (ids and splits of earlier prompts
    never change, so cached answers stay valid when the set grows).

    >>> prompts = build_prompts()
    >>> len(prompts), sorted({p["category"] for p in prompts})[:2], prompts[0]["split"]
    (720, ['chat', 'code'], 'heldout')
    """
    rng = random.Random(seed)
    earlier: dict[str, set[str]] = {}
    prompts = []
    for _ in range(ROUNDS):
        drawn = _round(rng, earlier)
        for i in range(PER_CATEGORY):
            for category in TEMPLATES:
                n = len(prompts)
                split = "heldout" if n % (HELDOUT_EVERY * len(TEMPLATES)) < len(TEMPLATES) else "train"
                prompts.append({"id": n, "category": category, "split": split, "prompt": drawn[category][i]})
        for category, texts in drawn.items():
            earlier.setdefault(category, set()).update(texts)
    return prompts


def write_prompts(path: Path = PROMPTS_FILE, seed: int = 0) -> int:
    prompts = build_prompts(seed)
    path.write_text("".join(json.dumps(p, ensure_ascii=False) + "\n" for p in prompts), encoding="utf-8")
    return len(prompts)


def read_prompts(path: Path = PROMPTS_FILE) -> list[dict]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]

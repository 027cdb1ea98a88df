"""The fixed prompt set of the benchmarks and ``specgate eval``, in one place."""

PROMPTS = [
    "Explain in two sentences why the sky is blue.",
    "Write a short poem about a lighthouse keeper.",
    "List three tips for learning a new programming language.",
    "What is the capital of France, and why is it famous?",
    "Describe a cat to someone who has never seen one.",
]

"""The held test conversations: the engine's equality tests against transformers
(tests/engine/test_smollm2.py) and the quality measurements of lossy options (int8 KV in
`make bench-transfer`) use the same ones."""

DOCUMENT = " ".join(
    f"Section {i}. The river town of Alder kept records of its {thing} for many years, and the "
    f"council met every {day} to discuss the harvest, the bridges and the school."
    for i, (thing, day) in enumerate(zip(
        ["mills", "boats", "orchards", "markets", "wells", "roads", "bells", "bakeries",
         "ferries", "gardens", "forges", "lamps"] * 2,
        ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday"] * 4)))

CONVERSATIONS = {
    "short": [{"role": "user", "content": "What is the capital of France?"}],
    "greeting": [{"role": "user", "content": "Hi!"}],
    "system": [{"role": "system", "content": "You are a terse Python expert."},
               {"role": "user", "content": "How do I reverse a list in Python? Show code."}],
    "multi_turn": [{"role": "user", "content": "Name three primary colors."},
                   {"role": "assistant", "content": "Red, yellow and blue."},
                   {"role": "user", "content": "Which of them is used for stop signs, and why?"}],
    "document": [{"role": "user", "content": DOCUMENT + "\n\nSummarize the text above in one sentence."}],
}

"""The drafting wing: every drafter plays the role in base.py; the model drafters share the one loop in
loop.py; registry.py builds each one by speculation method."""

"""A multi-turn environment, by example: repeat the letter asked, then the next one, for 3 turns. On the tiny model:

    python grpo.py policy.model_name=tiny-debug env.environment=examples.letters:LettersEnv grpo.max_rollout_turns=3

An environment is a plain class, one instance per sample (it must pickle: it steps in a worker process):
  __init__(row)   start an episode from a data row ({"prompt", "answer", ...});
  step(text)      the assistant's text of one turn -> (observation, reward, done): the text shown to the model next
                  (None: nothing), this turn's reward, and whether the episode is over;
  stop, role      optional class attributes: stop strings that end each turn, the first included (kept in the
                  output), and the chat role of the observations ("user" when absent).
A sample's reward is the sum of its turns'. An exception, a non-finite reward or a step past env.reward_timeout_s
ends the sample's episode with reward 0 and a warning, never the run.
"""

from grpo import debug_reward


class LettersEnv:
    turns = 3

    def __init__(self, row: dict):
        self.letter, self.turn = row["answer"], 0

    def step(self, text: str):
        reward = debug_reward("", text, self.letter)
        self.letter, self.turn = "abcd"[("abcd".index(self.letter) + 1) % 4], self.turn + 1
        return f"Now repeat the letter {self.letter}.", reward, self.turn == self.turns

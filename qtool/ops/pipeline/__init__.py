"""`qtool build RECIPE.yaml`: run a build recipe's steps, content-addressed.

Every source gets an identity (hub: repo + resolved commit [+ tensor selection]; path: the files' names,
sizes and sha256s, hashed when the build runs where none is on record; builtin: name + fixture version)
and every step a key = sha256 of (op, its `with` section, the keys of its inputs, qtool version). A step
whose key has a finished directory (`<work>/steps/<id>-<key12>/qtool-step.json`) is skipped; a changed source, option or
upstream output changes the key of that step and, through the chain, of every step after it, so exactly those re-run.
The final artifact (hard links of the last producing step) carries qtool-manifest.json with a `build`
section: recipe, sources with commits, each step's key, inputs and timing.

    p = plan(load_build_recipe("recipes/build/demo-tiny.yaml"), out=Path("build/demo-tiny"))
    report = run(p)
"""

from qtool.ops.pipeline.plan import BuildPlan, StepPlan, plan
from qtool.ops.pipeline.run import run

__all__ = ["BuildPlan", "StepPlan", "plan", "run"]

"""Settings shared by the whole suite."""

from hypothesis import Phase, settings

# For mutation runs (tests/MUTATION.md): a property test that kills a mutant need not
# shrink its failing example, which for the admission state machine took ~10x the run.
settings.register_profile("mutation", phases=[Phase.explicit, Phase.reuse, Phase.generate])

"""One module per model family, each defining ``TABLE`` (a `merge_engine.architectures.mappings.FamilyTable`).

Found by listing this package (`merge_engine.architectures.FAMILY_MODULES`): a new family is one new file.
"""

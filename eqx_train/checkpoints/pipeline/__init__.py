"""Save and restore as stages (`_save`: plan, snapshot, transfer, write, commit; `_restore`:
resolve, open, match, read, place), their options (`_options`), and multi-process
coordination. Imports only `format`, `storage` and `checkpoints._errors`."""

PRESET_DICTS: dict[str, dict] = {}

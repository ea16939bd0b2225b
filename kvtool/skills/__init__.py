"""Composable skill KV blocks: prefill a skill once, splice its KV into any context at any position.

    catalog = load_catalog("skills/", model)                  # compile or load cached .kvb blocks
    out = compose(model.runner, prefix_ids, [catalog.block("pdf")], query_ids, repair="recompute_first_k:k=16")
    engine = Engine(model, prefix_cache=SkillSplicer(catalog, repair="none", inner=prefix_cache))
"""

from kvtool.skills.block import SkillBlock, compile_ids, load_block, save_block, setup_of
from kvtool.skills.catalog import SkillCatalog, compile_skill, load_catalog
from kvtool.skills.compose import Composition, compose, compose_segments
from kvtool.skills.repair import REPAIRS, make_repair
from kvtool.skills.skillfile import Skill, SkillFileError, parse_skill, read_skill, read_skills
from kvtool.skills.splice import SkillSplicer, SpliceHandle, SpliceStats

__all__ = ["REPAIRS", "Composition", "Skill", "SkillBlock", "SkillCatalog", "SkillFileError", "SkillSplicer",
           "SpliceHandle", "SpliceStats", "compile_ids", "compile_skill", "compose", "compose_segments",
           "load_block", "load_catalog", "make_repair", "parse_skill", "read_skill", "read_skills", "save_block",
           "setup_of"]

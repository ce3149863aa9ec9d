"""The shared interface and every policy both backends use (router, pager, heat map,
group cache, placement, communication planner). See DESIGN.md for the seam."""

__version__ = "0.1.0"

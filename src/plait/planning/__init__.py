"""What the Planner (plait.roles.planner) is made of, apart from its step loop and its data state.

draws.py: the reading position in every source (cursor, mixture deficit) and drawing chunks from it;
step_costs.py: the cost of a step's items (LLM and vision encoder, per CP rank), the outliers held back
for cost, and the figures reported with a step (capacity certificate, image statistics).
"""

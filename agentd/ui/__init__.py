"""The browser view the agent serves at /ui/ (index.html, app.js, style.css): read-only, offline.

Everything it shows it asks the agent's own REST endpoints for (GET /cluster,
/nodes/NODE/..., /services, /flows); nothing is loaded from anywhere else.
"""

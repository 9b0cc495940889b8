"""SSH, the way every block that reaches a machine talks to it: who we are (``credentials``, a block), one verified
connection per host (``connection``, ``session``) and the rows ``gpuferry check`` reports of it.
"""

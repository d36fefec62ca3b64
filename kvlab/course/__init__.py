"""The course around the book, apart from the library the book teaches.

``checks`` (the lab graders), ``labs`` (solutions -> labs, never over a learner's cells), ``grade``
(``make grade``: a learner's scorecard), ``release`` (an nbgrader / GitHub Classroom release) and
``install`` (the library in a bare Jupyter). The book imports none of this; a test over the import
graph keeps it so.
"""

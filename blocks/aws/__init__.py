"""GPU nodes from AWS EC2 (``Ec2Provider``): instances made for a run, found again by their tag, reached and set
up as your own hosts are (``blocks/hosts/``), terminated at the end.
"""

variable "name" {
  description = "Prefix of every resource; the tables are <name>-nodes and <name>-replicas"
  type        = string
  default     = "ember"
}

variable "vpc_id" {
  type = string
}

variable "subnet_ids" {
  description = "Subnets (two or more availability zones) for the load balancer, the gateway and the GPU nodes"
  type        = list(string)
}

variable "certificate_arn" {
  description = "ACM certificate for the HTTPS listener"
  type        = string
}

variable "node_ami_id" {
  description = "GPU AMI with NVIDIA drivers and Python 3.11 (e.g. a Deep Learning AMI)"
  type        = string
}

variable "gateway_ami_id" {
  type = string
}

variable "node_instance_type" {
  type    = string
  default = "p5en.48xlarge"
}

variable "gateway_instance_type" {
  type    = string
  default = "c7i.large"
}

variable "node_gpus" {
  description = "GPUs per node instance, as the node agent reports them"
  type        = number
  default     = 8
}

variable "replicas_per_node" {
  type    = number
  default = 8
}

variable "max_nodes" {
  description = "The Auto Scaling Group's max_size: the gateway never asks for more"
  type        = number
  default     = 4
}

variable "ember_version" {
  description = "pip requirement the instances install, e.g. ember==0.1.0"
  type        = string
  default     = "ember"
}

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

variable "gateway_count" {
  description = "Gateways behind the load balancer; with more than one they share rate limits through Redis"
  type        = number
  default     = 1
}

variable "redis" {
  description = "ElastiCache Redis for shared rate limits; null (default) means on when gateway_count > 1"
  type        = bool
  default     = null
}

variable "redis_node_type" {
  type    = string
  default = "cache.t4g.micro"
}

variable "waf" {
  description = "A WAF web ACL (AWS managed common and known-bad-inputs rules) in front of the load balancer"
  type        = bool
  default     = true
}

variable "deletion_protection" {
  description = "Deletion protection on the load balancer; turn it off before `terraform destroy`"
  type        = bool
  default     = true
}

variable "force_destroy" {
  description = "Let `terraform destroy` delete the buckets with their packages, snapshots and logs in them"
  type        = bool
  default     = false
}

variable "client_cidrs" {
  description = "Who may reach the load balancer on 443"
  type        = list(string)
  default     = ["0.0.0.0/0"]
}

variable "log_retention_days" {
  description = "Days log groups and access logs are kept (auditors expect at least a year)"
  type        = number
  default     = 365
}

variable "noncurrent_days" {
  description = "Days an overwritten or deleted package or snapshot version is kept"
  type        = number
  default     = 30
}

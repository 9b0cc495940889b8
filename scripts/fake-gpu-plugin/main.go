// Command fake-gpu-plugin is a Kubernetes device plugin (the kubelet's v1beta1 gRPC API) for a node
// without GPUs: it advertises -gpus whole GPUs as -gpu-resource (nvidia.com/gpu) and -mig-count MIG
// slices as nvidia.com/mig-<-mig-profile>, the names NVIDIA's device plugin uses with the "mixed" MIG
// strategy. The kubelet schedules and accounts for them as for real devices; Allocate hands the
// container the chosen device IDs in NVIDIA_VISIBLE_DEVICES (what NVIDIA's container runtime reads to
// inject the devices; no device node is injected here, as there is none).
//
// Built by scripts/k8s.sh from the kubelet's own source tree (its vendored gRPC and API), and run
// inside the node's namespaces. A restarting kubelet empties the device-plugin directory: the plugin
// sees its socket gone and serves and registers again.
package main

import (
	"context"
	"flag"
	"fmt"
	"log"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"google.golang.org/grpc"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

// resource is one advertised resource name with its devices, served on a socket of its own.
type resource struct {
	name    string
	socket  string // file name in the device-plugin directory
	devices []*pluginapi.Device
	server  *grpc.Server
}

func (r *resource) GetDevicePluginOptions(context.Context, *pluginapi.Empty) (*pluginapi.DevicePluginOptions, error) {
	return &pluginapi.DevicePluginOptions{}, nil
}

func (r *resource) ListAndWatch(_ *pluginapi.Empty, stream pluginapi.DevicePlugin_ListAndWatchServer) error {
	if err := stream.Send(&pluginapi.ListAndWatchResponse{Devices: r.devices}); err != nil {
		return err
	}
	<-stream.Context().Done() // the devices never change; the stream ends with the kubelet's connection
	return nil
}

func (r *resource) GetPreferredAllocation(context.Context, *pluginapi.PreferredAllocationRequest) (*pluginapi.PreferredAllocationResponse, error) {
	return &pluginapi.PreferredAllocationResponse{}, nil
}

func (r *resource) Allocate(_ context.Context, req *pluginapi.AllocateRequest) (*pluginapi.AllocateResponse, error) {
	known := map[string]bool{}
	for _, d := range r.devices {
		known[d.ID] = true
	}
	out := &pluginapi.AllocateResponse{}
	for _, c := range req.ContainerRequests {
		for _, id := range c.DevicesIDs {
			if !known[id] {
				return nil, fmt.Errorf("%s: unknown device %q", r.name, id)
			}
		}
		log.Printf("%s: allocate %s", r.name, strings.Join(c.DevicesIDs, ","))
		out.ContainerResponses = append(out.ContainerResponses, &pluginapi.ContainerAllocateResponse{
			Envs: map[string]string{"NVIDIA_VISIBLE_DEVICES": strings.Join(c.DevicesIDs, ",")},
		})
	}
	return out, nil
}

func (r *resource) PreStartContainer(context.Context, *pluginapi.PreStartContainerRequest) (*pluginapi.PreStartContainerResponse, error) {
	return &pluginapi.PreStartContainerResponse{}, nil
}

// serve starts the resource's gRPC server on a fresh socket and registers it with the kubelet.
func (r *resource) serve(dir string) error {
	path := filepath.Join(dir, r.socket)
	if err := os.Remove(path); err != nil && !os.IsNotExist(err) {
		return err
	}
	listener, err := net.Listen("unix", path)
	if err != nil {
		return err
	}
	r.server = grpc.NewServer()
	pluginapi.RegisterDevicePluginServer(r.server, r)
	go r.server.Serve(listener)

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := grpc.DialContext(ctx, filepath.Join(dir, "kubelet.sock"), grpc.WithInsecure(), grpc.WithBlock(),
		grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", addr)
		}))
	if err != nil {
		r.stop()
		return fmt.Errorf("connecting to the kubelet: %w", err)
	}
	defer conn.Close()
	_, err = pluginapi.NewRegistrationClient(conn).Register(ctx, &pluginapi.RegisterRequest{
		Version: pluginapi.Version, Endpoint: r.socket, ResourceName: r.name,
		Options: &pluginapi.DevicePluginOptions{},
	})
	if err != nil {
		r.stop()
		return fmt.Errorf("registering %s: %w", r.name, err)
	}
	log.Printf("registered %s (%d devices) on %s", r.name, len(r.devices), path)
	return nil
}

func (r *resource) stop() {
	if r.server != nil {
		r.server.Stop()
		r.server = nil
	}
}

func devices(prefix string, n int) []*pluginapi.Device {
	out := make([]*pluginapi.Device, 0, n)
	for i := 0; i < n; i++ {
		out = append(out, &pluginapi.Device{ID: fmt.Sprintf("%s-%d", prefix, i), Health: pluginapi.Healthy})
	}
	return out
}

func main() {
	dir := flag.String("dir", pluginapi.DevicePluginPath, "the kubelet's device-plugin directory")
	gpus := flag.Int("gpus", 4, "whole GPUs to advertise")
	gpuResource := flag.String("gpu-resource", "nvidia.com/gpu", "resource name of whole GPUs")
	migProfile := flag.String("mig-profile", "1g.10gb", "MIG profile of the slices (resource nvidia.com/mig-<profile>)")
	migCount := flag.Int("mig-count", 7, "MIG slices to advertise (0: none)")
	node := flag.String("node", "node", "node name, part of the device IDs")
	flag.Parse()

	var resources []*resource
	if *gpus > 0 {
		resources = append(resources, &resource{name: *gpuResource, socket: "gpuferry-gpu.sock",
			devices: devices("GPU-fake-"+*node, *gpus)})
	}
	if *migCount > 0 {
		resources = append(resources, &resource{name: "nvidia.com/mig-" + *migProfile, socket: "gpuferry-mig.sock",
			devices: devices("MIG-fake-"+*node+"-"+*migProfile, *migCount)})
	}
	signals := make(chan os.Signal, 1)
	signal.Notify(signals, syscall.SIGTERM, syscall.SIGINT)
	tick := time.NewTicker(500 * time.Millisecond)
	defer tick.Stop()
	for {
		for _, r := range resources {
			// No socket: not served yet, or a restarting kubelet removed it. Serve (again) and register.
			if _, err := os.Stat(filepath.Join(*dir, r.socket)); err == nil && r.server != nil {
				continue
			}
			r.stop()
			if _, err := os.Stat(filepath.Join(*dir, "kubelet.sock")); err != nil {
				continue // the kubelet is not (yet) listening
			}
			if err := r.serve(*dir); err != nil {
				log.Printf("%s: %v (retrying)", r.name, err)
			}
		}
		select {
		case <-signals:
			for _, r := range resources {
				r.stop()
				os.Remove(filepath.Join(*dir, r.socket))
			}
			return
		case <-tick.C:
		}
	}
}

// Command fake-gpu-plugin is a Kubernetes device plugin (the kubelet's v1beta1 gRPC API) for a node
// without GPUs, with the device nodes a driver would have made for them. It advertises -gpus whole GPUs as
// -gpu-resource (nvidia.com/gpu) and -mig-count MIG slices as nvidia.com/mig-<-mig-profile>, the names NVIDIA's
// device plugin uses with the "mixed" MIG strategy. The kubelet schedules and accounts for them as for real
// devices.
//
// Allocate answers as NVIDIA's plugin does when it passes device specs: the chosen IDs in
// NVIDIA_VISIBLE_DEVICES, and a device spec per node the container needs, which the runtime creates inside
// the container and lets it open. The nodes are character devices made under -dev-root (a directory of the
// stack's own, never the host's /dev), numbered as the driver numbers them, with no driver behind them:
//   - /dev/nvidiactl (195, 255), with every allocation;
//   - a whole GPU: /dev/nvidia<N> (195, N), N = 0 .. -gpus - 1;
//   - a MIG slice: its parent GPU's /dev/nvidia<P> (P = -gpus, -gpus + 1, ...: seven slices per GPU, the most
//     one GPU holds) and the capability nodes /dev/nvidia-caps/nvidia-cap<M> of its GPU instance and of its
//     compute instance, which grant access to the slice. Slice k of a GPU is GPU instance 7+k (how the
//     driver numbers the seven 1g instances of one GPU) with compute instance 0; the minors follow the
//     driver's table (/proc/driver/nvidia-caps/mig-minors: gpu<P>/gi<G>/access = 3 + 135*P + 9*G, and its
//     ci<C>/access that + 1 + C); the major, dynamic on a real machine, is one no driver here holds.
//
// What a container cannot do with them: open a GPU (no driver, no NVIDIA container runtime or libraries).
//
// Built by scripts/k8s.sh from the kubelet's own source tree (its vendored gRPC and API), and run
// inside the node's namespaces. A restarting kubelet empties the device-plugin directory: the plugin
// sees its socket gone and serves and registers again.
package main

import (
	"context"
	"errors"
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

	"golang.org/x/sys/unix"
	"google.golang.org/grpc"
	pluginapi "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

const (
	nvidiaMajor     = 195 // the NVIDIA driver's fixed character major
	migSlicesPerGPU = 7   // the most MIG slices one GPU holds
	migFirstGI      = 7   // the GPU instance ID of a GPU's first 1g slice
)

// node is a character device a container gets: its path inside the container and its numbers.
type node struct {
	path         string // /dev/...
	major, minor uint32
}

var nvidiactl = node{"/dev/nvidiactl", nvidiaMajor, 255}

// migNodes: what a MIG slice needs, its parent GPU's node and the capability nodes of its GPU and compute
// instance, in the driver's numbering (/proc/driver/nvidia-caps/mig-minors: 15 GPU instances of 9 minors each
// per GPU, after "config" 1 and "monitor" 2).
func migNodes(capsMajor uint32, parent, gi, ci uint32) []node {
	giMinor := 3 + 135*parent + 9*gi
	ciMinor := giMinor + 1 + ci
	return []node{
		{fmt.Sprintf("/dev/nvidia%d", parent), nvidiaMajor, parent},
		{fmt.Sprintf("/dev/nvidia-caps/nvidia-cap%d", giMinor), capsMajor, giMinor},
		{fmt.Sprintf("/dev/nvidia-caps/nvidia-cap%d", ciMinor), capsMajor, ciMinor},
	}
}

// resource is one advertised resource name with its devices, served on a socket of its own.
type resource struct {
	name    string
	socket  string // file name in the device-plugin directory
	devices []*pluginapi.Device
	nodes   map[string][]node // device ID -> the nodes it needs (nvidiactl aside)
	devRoot string            // where the nodes are on the node's filesystem
	server  *grpc.Server
}

func (r *resource) add(id string, nodes ...node) {
	r.devices = append(r.devices, &pluginapi.Device{ID: id, Health: pluginapi.Healthy})
	r.nodes[id] = nodes
}

func hostPath(devRoot string, n node) string {
	return filepath.Join(devRoot, strings.TrimPrefix(n.path, "/dev/"))
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
	out := &pluginapi.AllocateResponse{}
	for _, c := range req.ContainerRequests {
		specs := []*pluginapi.DeviceSpec{}
		seen := map[string]bool{}
		for _, id := range c.DevicesIDs {
			nodes, ok := r.nodes[id]
			if !ok {
				return nil, fmt.Errorf("%s: unknown device %q", r.name, id)
			}
			for _, n := range append([]node{nvidiactl}, nodes...) {
				if !seen[n.path] { // two slices of one GPU share its node
					seen[n.path] = true
					specs = append(specs, &pluginapi.DeviceSpec{ContainerPath: n.path, HostPath: hostPath(r.devRoot, n),
						Permissions: "rw"})
				}
			}
		}
		log.Printf("%s: allocate %s", r.name, strings.Join(c.DevicesIDs, ","))
		out.ContainerResponses = append(out.ContainerResponses, &pluginapi.ContainerAllocateResponse{
			Envs:    map[string]string{"NVIDIA_VISIBLE_DEVICES": strings.Join(c.DevicesIDs, ",")},
			Devices: specs,
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

// charMajors: the character majors drivers hold on this machine (/proc/devices).
func charMajors() (map[uint32]bool, error) {
	data, err := os.ReadFile("/proc/devices")
	if err != nil {
		return nil, err
	}
	used, inChar := map[uint32]bool{}, false
	for _, line := range strings.Split(string(data), "\n") {
		switch {
		case strings.HasPrefix(line, "Character devices:"):
			inChar = true
		case strings.HasPrefix(line, "Block devices:"):
			inChar = false
		case inChar:
			var major uint32
			if _, err := fmt.Sscan(line, &major); err == nil {
				used[major] = true
			}
		}
	}
	return used, nil
}

// makeNode makes n under devRoot, unless a character device with its numbers is there.
func makeNode(devRoot string, n node) error {
	path := hostPath(devRoot, n)
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err == nil && st.Mode&unix.S_IFMT == unix.S_IFCHR && st.Rdev == unix.Mkdev(n.major, n.minor) {
		return nil
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	if err := os.Remove(path); err != nil && !os.IsNotExist(err) {
		return err
	}
	if err := unix.Mknod(path, unix.S_IFCHR|0o666, int(unix.Mkdev(n.major, n.minor))); err != nil {
		return fmt.Errorf("mknod %s: %w", path, err)
	}
	return os.Chmod(path, 0o666) // not narrowed by the umask
}

// newResources: the advertised resources, and the device nodes they need made.
func newResources(nodeName string, gpus int, gpuResource, migProfile string, migCount int, devRoot string) ([]*resource, error) {
	majors, err := charMajors()
	if err != nil {
		return nil, err
	}
	if majors[nvidiaMajor] {
		return nil, errors.New("this machine has an NVIDIA driver (major 195 in /proc/devices): fake GPU nodes would open its devices")
	}
	capsMajor := uint32(0) // where the kernel hands out dynamic majors, one no driver holds
	for m := uint32(511); m >= 384 && capsMajor == 0; m-- {
		if !majors[m] {
			capsMajor = m
		}
	}
	if capsMajor == 0 && migCount > 0 {
		return nil, errors.New("no free character major in 384-511 for the MIG capability nodes")
	}
	var resources []*resource
	if gpus > 0 {
		r := &resource{name: gpuResource, socket: "gpuferry-gpu.sock", nodes: map[string][]node{}, devRoot: devRoot}
		for i := 0; i < gpus; i++ {
			r.add(fmt.Sprintf("GPU-fake-%s-%d", nodeName, i), node{fmt.Sprintf("/dev/nvidia%d", i), nvidiaMajor, uint32(i)})
		}
		resources = append(resources, r)
	}
	if migCount > 0 {
		r := &resource{name: "nvidia.com/mig-" + migProfile, socket: "gpuferry-mig.sock", nodes: map[string][]node{},
			devRoot: devRoot}
		for k := 0; k < migCount; k++ {
			parent := uint32(gpus + k/migSlicesPerGPU)
			r.add(fmt.Sprintf("MIG-fake-%s-%s-%d", nodeName, migProfile, k),
				migNodes(capsMajor, parent, uint32(migFirstGI+k%migSlicesPerGPU), 0)...)
		}
		resources = append(resources, r)
	}
	if err := makeNode(devRoot, nvidiactl); err != nil {
		return nil, err
	}
	for _, r := range resources {
		for _, nodes := range r.nodes {
			for _, n := range nodes {
				if err := makeNode(devRoot, n); err != nil {
					return nil, err
				}
			}
		}
	}
	log.Printf("device nodes under %s (MIG capability major %d)", devRoot, capsMajor)
	return resources, nil
}

func main() {
	dir := flag.String("dir", pluginapi.DevicePluginPath, "the kubelet's device-plugin directory")
	gpus := flag.Int("gpus", 4, "whole GPUs to advertise")
	gpuResource := flag.String("gpu-resource", "nvidia.com/gpu", "resource name of whole GPUs")
	migProfile := flag.String("mig-profile", "1g.10gb", "MIG profile of the slices (resource nvidia.com/mig-<profile>)")
	migCount := flag.Int("mig-count", 7, "MIG slices to advertise (0: none)")
	nodeName := flag.String("node", "node", "node name, part of the device IDs")
	devRoot := flag.String("dev-root", "", "directory of the fake device nodes, a stand-in for the host's /dev (not /dev itself)")
	flag.Parse()
	if !filepath.IsAbs(*devRoot) || filepath.Clean(*devRoot) == "/dev" {
		log.Fatalf("-dev-root=%q: give an absolute directory of the node's own, not /dev", *devRoot)
	}

	resources, err := newResources(*nodeName, *gpus, *gpuResource, *migProfile, *migCount, filepath.Clean(*devRoot))
	if err != nil {
		log.Fatalf("the fake devices: %v", err)
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
